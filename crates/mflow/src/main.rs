use clap::Parser;

// Planning a large DAG makes many short-lived allocations; mimalloc keeps them off the page-fault
// path. Its transparent huge pages stay on: without them a no-op of 1000 stages took 0.10 s of
// system time instead of 0.045 (one fault per 4 KiB page), though its peak RSS fell by 40%.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let cli = mflow::cli::Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_env("RUST_LOG").unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    if cli.log_format == mflow::cli::LogFormat::Json {
        tracing_subscriber::fmt().json().with_env_filter(filter).with_writer(std::io::stderr).init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).without_time().init();
    }
    let code = match mflow::cli::main(cli) {
        Ok(code) => code,
        Err(e) => {
            let code = e.exit_code();
            eprintln!("{:?}", miette::Report::new(e));
            code
        }
    };
    std::process::exit(code.code());
}
