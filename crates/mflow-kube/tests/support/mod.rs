#![allow(dead_code)]
pub mod controller;
pub mod fake_api;
pub mod schema;
