//! An in-process Kubernetes API server and a fake Trainer controller, for tests of mflow-kube
//! and of the engine's Kubernetes backend (cargo feature `testing`).

pub mod controller;
pub mod fake_api;
pub mod schema;
pub mod structural;
