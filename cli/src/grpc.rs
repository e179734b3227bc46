//! `levee import grpc-service-config` and `levee grpc-config`: gRPC's service config both ways.
//! The conversion is the core's (`levee_core::grpc::service_config`); this only reads the
//! files and formats its answer.

use levee_core::grpc::service_config::{self, Select};
use levee_core::LoadError;

/// Errors and notes as lines: `path: message`.
pub fn lines(errors: &[LoadError]) -> Vec<String> {
    errors.iter().map(|e| if e.path.is_empty() { e.message.clone() } else { format!("{}: {}", e.path, e.message) }).collect()
}

/// The imported document, its policies and the notes; or every error.
pub fn import(text: &str, source: &str) -> Result<(String, Vec<String>, Vec<String>), Vec<String>> {
    let imported = service_config::import(text, source).map_err(|e| lines(&e))?;
    let names = imported.policies.iter().map(|(name, _)| name.clone()).collect();
    Ok((imported.document, names, lines(&imported.notes)))
}

/// The service config (JSON) and the notes on what gRPC cannot express; or every error.
pub fn export(document: &str, policy: Option<&str>, all: bool) -> Result<(String, Vec<String>), Vec<String>> {
    let select = match (all, policy) {
        (true, _) => Select::All,
        (false, Some(name)) => Select::Named(name),
        (false, None) => Select::First,
    };
    let exported = service_config::export(document, select).map_err(|e| lines(&e))?;
    Ok((exported.json, lines(&exported.notes)))
}
