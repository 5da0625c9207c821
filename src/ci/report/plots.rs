//! The report's charts as SVG (plotters), and PNG renderings of the same SVG (resvg) for CI
//! artifacts.

use std::path::Path;

use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;

use crate::ci::CiError;

pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

const W: u32 = 760;
const H: u32 = 340;

fn plot_err(what: &str) -> impl Fn(DrawingAreaErrorKind<std::io::Error>) -> CiError + '_ {
    move |e| CiError::Plot { what: what.to_string(), message: e.to_string() }
}

/// A line chart of `series` against `x_label`; None when there is nothing to draw.
pub fn line_chart(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> Result<Option<String>, CiError> {
    let pts = || series.iter().flat_map(|s| s.points.iter());
    if pts().next().is_none() {
        return Ok(None);
    }
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts() {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    // A single point or a flat line still needs a non-empty range.
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let pad = if y1 > y0 { (y1 - y0) * 0.05 } else { y0.abs().max(1.0) * 0.05 };
    let (y0, y1) = (y0 - pad, y1 + pad);
    let mut svg = String::new();
    {
        let err = plot_err(title);
        let root = SVGBackend::with_string(&mut svg, (W, H)).into_drawing_area();
        root.fill(&WHITE).map_err(&err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(&err)?;
        chart
            .configure_mesh()
            .x_desc(x_label)
            .y_desc(y_label)
            .x_label_formatter(&|v| crate::ci::summary::num(*v))
            .y_label_formatter(&|v| crate::ci::summary::num(*v))
            .label_style(("sans-serif", 13))
            .axis_desc_style(("sans-serif", 13))
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(&err)?;
        for (i, s) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let style = color.stroke_width(2);
            if s.points.len() == 1 {
                chart
                    .draw_series(s.points.iter().map(|&p| Circle::new(p, 4, color.filled())))
                    .map_err(&err)?
                    .label(&s.label)
                    .legend(move |(x, y)| Circle::new((x + 10, y), 4, color.filled()));
            } else {
                chart
                    .draw_series(LineSeries::new(s.points.iter().copied(), style))
                    .map_err(&err)?
                    .label(&s.label)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .draw()
            .map_err(&err)?;
        root.present().map_err(&err)?;
    }
    Ok(Some(svg))
}

pub struct Bar {
    pub stage: String,
    pub start: f64,
    pub end: f64,
    pub status: crate::record::StageStatus,
}

/// The stages on a time axis (seconds since the run started), one row each, coloured by status.
pub fn timeline(bars: &[Bar]) -> Result<Option<String>, CiError> {
    if bars.is_empty() {
        return Ok(None);
    }
    use crate::record::StageStatus as S;
    let n = bars.len() as u32;
    // Room on the right for the status labels.
    let t1 = bars.iter().map(|b| b.end).fold(0.0f64, f64::max).max(0.001) * 1.3;
    let height = 110 + 36 * n;
    let label_width = bars.iter().map(|b| b.stage.len()).max().unwrap_or(4) as u32 * 8 + 16;
    let mut svg = String::new();
    {
        let err = plot_err("timeline");
        let root = SVGBackend::with_string(&mut svg, (W, height)).into_drawing_area();
        root.fill(&WHITE).map_err(&err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption("Stage timeline", ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(label_width.max(60))
            .build_cartesian_2d(0.0..t1, (0..n).into_segmented())
            .map_err(&err)?;
        // Row 0 is drawn at the bottom: the first stage gets the top row.
        let name_of = |v: &SegmentValue<u32>| match v {
            SegmentValue::CenterOf(i) | SegmentValue::Exact(i) if *i < n => bars[(n - 1 - i) as usize].stage.clone(),
            _ => String::new(),
        };
        chart
            .configure_mesh()
            .x_desc("seconds since the run started")
            .x_label_formatter(&|v| crate::ci::summary::num(*v))
            .y_label_formatter(&name_of)
            .y_labels(n as usize)
            .disable_y_mesh()
            .light_line_style(WHITE.mix(0.0))
            .label_style(("sans-serif", 13))
            .axis_desc_style(("sans-serif", 13))
            .draw()
            .map_err(&err)?;
        for (i, b) in bars.iter().enumerate() {
            let row = n - 1 - i as u32;
            let color = match b.status {
                S::Succeeded => RGBColor(46, 139, 87),
                S::Cached => RGBColor(100, 149, 237),
                S::Failed => RGBColor(205, 55, 55),
                _ => RGBColor(160, 160, 160),
            };
            // Cached stages take no time; keep them visible as a thin bar.
            let end = if b.end - b.start < t1 * 0.004 { b.start + t1 * 0.004 } else { b.end };
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(b.start, SegmentValue::Exact(row)), (end, SegmentValue::Exact(row + 1))],
                    color.filled(),
                )))
                .map_err(&err)?;
            let label = format!("{} {:.1}s", crate::ci::run_data::status_word(b.status), b.end - b.start);
            chart
                .draw_series(std::iter::once(Text::new(
                    label,
                    (end + t1 * 0.01, SegmentValue::CenterOf(row)),
                    ("sans-serif", 12),
                )))
                .map_err(&err)?;
        }
        root.present().map_err(&err)?;
    }
    Ok(Some(svg))
}

/// Renders an SVG to a PNG file with the system's fonts.
pub fn write_png(
    svg: &str,
    path: &Path,
    fonts: &std::sync::Arc<resvg::usvg::fontdb::Database>,
    owned: &crate::user_output::Owned,
) -> Result<(), CiError> {
    use resvg::{tiny_skia, usvg};
    let opt = usvg::Options { fontdb: fonts.clone(), ..usvg::Options::default() };
    let tree = usvg::Tree::from_str(svg, &opt)
        .map_err(|e| CiError::Plot { what: path.display().to_string(), message: e.to_string() })?;
    let size = tree.size().to_int_size();
    let mut pixmap = tiny_skia::Pixmap::new(size.width(), size.height())
        .ok_or_else(|| CiError::Plot { what: path.display().to_string(), message: "empty image".into() })?;
    resvg::render(&tree, tiny_skia::Transform::default(), &mut pixmap.as_mut());
    let png =
        pixmap.encode_png().map_err(|e| CiError::Plot { what: path.display().to_string(), message: e.to_string() })?;
    Ok(crate::user_output::write(path, &png, owned)?)
}

/// The system's fonts, with a sans-serif family that exists here (the default, Arial, often
/// does not).
pub fn system_fonts() -> std::sync::Arc<resvg::usvg::fontdb::Database> {
    let mut db = resvg::usvg::fontdb::Database::new();
    db.load_system_fonts();
    let families: Vec<String> = db.faces().flat_map(|f| f.families.iter().map(|(name, _)| name.clone())).collect();
    let pick = ["DejaVu Sans", "Liberation Sans", "Noto Sans", "Arial", "Helvetica"]
        .iter()
        .find(|f| families.iter().any(|x| x == *f))
        .map(|s| s.to_string());
    if let Some(f) = pick.or_else(|| families.iter().find(|f| f.contains("Sans") && !f.contains("Mono")).cloned()) {
        db.set_sans_serif_family(f);
    }
    std::sync::Arc::new(db)
}
