//! The checkpoint commands on their own, for benchmarks and debugging:
//! `mflow-ckpt model|convert|export ...` with the same arguments as `mflow`.

use clap::{Parser, Subcommand};
use mflow_ckpt::cli;

#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Model(cli::ModelArgs),
    Convert(cli::ConvertArgs),
    Export(cli::ExportArgs),
}

fn main() -> miette::Result<()> {
    match Args::parse().command {
        Command::Model(a) => cli::model(&a),
        Command::Convert(a) => cli::convert(&a),
        Command::Export(a) => cli::export(&a),
    }
}
