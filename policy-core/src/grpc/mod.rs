//! gRPC: what the core knows of gRPC beyond classifying a status (which is
//! [`crate::classify`]'s) and parsing `grpc-retry-pushback-ms` (which is
//! [`crate::retry_after`]'s).
//!
//! [`service_config`] converts gRPC's service config (`methodConfig[].retryPolicy`,
//! `hedgingPolicy`, `timeout`, `retryThrottling`; gRFC A6) into a Levee policy document and a
//! policy back into the service config that makes a plain gRPC client behave as close to it
//! as gRPC can. These are pure functions of text (no I/O), written once here so that every
//! host can offer them; the `levee` command line does (`levee import grpc-service-config`,
//! `levee grpc-config`). They are not part of the WIT, so the component does not carry them.

pub mod service_config;
