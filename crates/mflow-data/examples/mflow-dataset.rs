//! Standalone driver of the `dataset` stage with the same arguments as `mflow dataset`, used by
//! the tokenization benchmark (benches/tokenize).

use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: mflow_data::DatasetArgs,
}

fn main() -> miette::Result<()> {
    mflow_data::run(&Cli::parse().args)
}
