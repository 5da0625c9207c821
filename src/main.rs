use clap::Parser;

// Planning a large DAG makes many short-lived allocations; mimalloc keeps them off the page-fault
// path. Built without transparent huge pages: right after other work has churned memory, getting
// and zeroing 2 MiB pages made a 1000-stage no-op 1.6x slower (docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let cli = mflow::cli::Cli::parse();
    // The Kubernetes client's own complaints (a watch that broke, a server that went away) are
    // said once in mflow's words by the backend; RUST_LOG still shows them.
    let filter = tracing_subscriber::EnvFilter::try_from_env("RUST_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,kube_client=off,kube_runtime=off"));
    if cli.log_format == mflow::cli::LogFormat::Json {
        tracing_subscriber::fmt().json().with_env_filter(filter).with_writer(std::io::stderr).init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).without_time().init();
    }
    tracing::debug!("started");
    // Names in messages (users, namespaces, pods, commands to copy) are never broken at their
    // hyphens, nor long paths and URLs inside.
    let _ = miette::set_hook(Box::new(|_| {
        Box::new(miette::MietteHandlerOpts::new().word_splitter(textwrap::WordSplitter::NoHyphenation).break_words(false).build())
    }));
    let code = match mflow::cli::main(cli) {
        Ok(code) => code,
        Err(e) => {
            let code = e.exit_code();
            eprintln!("{:?}", miette::Report::new(e));
            code
        }
    };
    tracing::debug!("done");
    exit(code.code())
}

/// Ends the process without the allocator's teardown: the kernel frees the heap at once, while
/// mimalloc's exit handler walked and returned every page first (7% of a large no-op run).
fn exit(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: nothing is left to run; both standard streams are flushed above.
    unsafe { libc::_exit(code) }
}
