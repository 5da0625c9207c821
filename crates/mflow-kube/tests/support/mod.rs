#![allow(unused_imports)]
pub use mflow_kube::testing::{controller, fake_api, schema};
