use clap::FromArgMatches;

// Planning a large DAG makes many short-lived allocations; mimalloc keeps them off the page-fault
// path. Built without transparent huge pages: right after other work has churned memory, getting
// and zeroing 2 MiB pages made a 1000-stage no-op 1.6x slower (docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    mflow::cli::complete::answer_shell();
    let matches = mflow::cli::args::command().get_matches();
    let cli = mflow::cli::Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // The Kubernetes client's own complaints (a watch that broke, a server that went away) are
    // said once in mflow's words by the backend; RUST_LOG still shows them.
    let level = match (cli.global.quiet, cli.global.verbose) {
        (true, _) => "error",
        (false, 0) => "warn",
        (false, 1) => "warn,mflow=debug,mflow_kube=debug",
        _ => "warn,mflow=trace,mflow_kube=trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("RUST_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("{level},kube_client=off,kube_runtime=off")));
    let color = cli.global.color.enabled();
    // A log line that cannot be written is dropped: the subscriber's own report of it would
    // `eprintln!` into the same closed stream and panic (`mflow run SPEC -v 2>&1 | head`).
    if cli.global.output_format == mflow::cli::args::OutputFormat::Json {
        tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .log_internal_errors(false)
            .init();
    } else {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .log_internal_errors(false)
            .with_ansi(color)
            .without_time()
            .init();
    }
    tracing::debug!("started");
    // Names in messages (users, namespaces, pods, commands to copy) are never broken at their
    // hyphens, nor long paths and URLs inside; no text of a message is of megabytes (`bounded`).
    let _ = miette::set_hook(Box::new(move |_| {
        Box::new(mflow::cli::bounded::Handler(
            miette::MietteHandlerOpts::new()
                .word_splitter(textwrap::WordSplitter::NoHyphenation)
                .break_words(false)
                .color(color)
                .build(),
        ))
    }));
    let code = match mflow::cli::main(cli) {
        Ok(code) => code,
        Err(e) => {
            let code = e.exit_code();
            mflow::errln!("{:?}", miette::Report::new(e));
            code
        }
    };
    tracing::debug!("done");
    mflow::exit::now(code)
}
