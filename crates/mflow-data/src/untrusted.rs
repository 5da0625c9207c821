//! Opening and quoting files a user hands to mflow's dataset stage.
//!
//! Inputs and tokenizers are opened only if they are regular files (a FIFO would block a read
//! forever), a tokenizer's companion files must resolve inside its directory, and error
//! messages quote at most a short excerpt of anything read from a file. All of it is the
//! workspace's one reader of files someone else wrote (`mflow_untrusted`).

pub use mflow_untrusted::{excerpt, not_regular, open_regular, read_bounded, resolve_inside};
