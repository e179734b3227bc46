//! Every vector, natively and through the component; both must match the expectations and
//! each other exactly.
// Tests may index and panic: the no-panic lints guard library code reachable from input.
#![allow(clippy::indexing_slicing, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use levee_conformance::component::Wasm;
use levee_conformance::{replay, vector_files, Native};
use serde_json::Value;

fn load(path: &std::path::Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    serde_json::from_str(&text).unwrap_or(Value::Null)
}

#[test]
fn every_vector_natively_and_through_the_component() {
    let files = vector_files();
    assert!(files.len() >= 100, "expected at least 100 vectors, found {}", files.len());
    let bless = std::env::var_os("LEVEE_BLESS").is_some();
    let mut failures = Vec::new();
    for path in &files {
        let vector = load(path);
        assert!(vector.is_object(), "{} is not a JSON object", path.display());
        let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("");
        assert_eq!(vector.get("name").and_then(Value::as_str), Some(stem), "{}: name must equal the file name", path.display());
        let (native_out, native_bad) = match replay::<Native>(&vector) {
            Ok(r) => r,
            Err(e) => {
                failures.push(e);
                continue;
            }
        };
        let (wasm_out, wasm_bad) = match replay::<Wasm>(&vector) {
            Ok(r) => r,
            Err(e) => {
                failures.push(e);
                continue;
            }
        };
        if native_out != wasm_out {
            failures.push(format!("{stem}: native and component differ"));
        }
        if bless {
            // Blessing fills in expectations a vector leaves out; it never overrides one that
            // a person wrote and the engine disagrees with.
            if !native_bad.is_empty() {
                failures.extend(native_bad.into_iter().map(|m| format!("native (not blessed): {m}")));
                continue;
            }
            let text = serde_json::to_string_pretty(&native_out).unwrap_or_default();
            let _ = std::fs::write(path, text + "\n");
            continue;
        }
        failures.extend(native_bad.into_iter().map(|m| format!("native: {m}")));
        failures.extend(wasm_bad.into_iter().map(|m| format!("component: {m}")));
        // A checked-in vector states every expectation in full, so that hosts compare exactly.
        for (i, step) in vector.get("steps").and_then(Value::as_array).into_iter().flatten().enumerate() {
            let op = step.get("op").and_then(Value::as_str).unwrap_or("");
            let needs = !matches!(op, "cancel" | "export_import");
            if needs && step.get("expect").is_none() {
                failures.push(format!("{stem} step {i}: no expectation"));
            }
            if let Some(e) = step.get("expect").filter(|e| e.get("kind").is_some()) {
                if e.get("verdict").is_none() {
                    failures.push(format!("{stem} step {i}: verdict expectations carry the raw `verdict`"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn the_component_has_zero_imports_and_fits_the_size_budget() {
    assert_eq!(levee_conformance::component::component_imports().ok(), Some(0));
    assert_eq!(levee_build::count_imports(levee_conformance::component::COMPONENT).ok(), Some(0));
    let size = levee_conformance::component::COMPONENT.len();
    assert!(size < 200 * 1024, "the component is {size} bytes; the budget is 200 KiB");
}
