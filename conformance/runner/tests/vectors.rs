//! Every vector, natively and through the component (starting unkeyed calls through both
//! `engine.start` and `start-unkeyed`); all must match the expectations and each other exactly.
// Tests may index and panic: the no-panic lints guard library code reachable from input.
#![allow(clippy::indexing_slicing, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use levee_conformance::component::{Compiled, Wasm, WasmUnkeyed};
use levee_conformance::{replay, vector_files, Native};
use levee_core::{InvalidCode, Verdict, VerdictKind};
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
        match replay::<WasmUnkeyed>(&vector) {
            Ok((out, _)) if out == wasm_out => {}
            Ok(_) => failures.push(format!("{stem}: `start-unkeyed` and `engine.start` differ")),
            Err(e) => failures.push(e),
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
            let needs = !matches!(op, "cancel" | "export_import" | "snapshot_import" | "executor" | "exec_forget");
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
    assert!(size <= 512 * 1024, "the component is {size} bytes; the budget is 512 KiB (docs/performance.md)");
}

#[test]
fn start_unkeyed_names_engines_by_an_id_that_dies_with_them() {
    const DOC: &str = "policies:\n  api: {attempts: 2}\n";
    let (mut store, levee) = Compiled::new().unwrap().instantiate().unwrap();
    let api = levee.levee_policy_engine_api();
    let a = api.engine().call_load(&mut store, DOC, 1).unwrap().unwrap();
    let b = api.engine().call_load(&mut store, DOC, 1).unwrap().unwrap();
    let (ia, ib) = (api.engine().call_id(&mut store, a).unwrap(), api.engine().call_id(&mut store, b).unwrap());
    assert!(ia != 0 && ib != 0 && ia != ib, "ids {ia} and {ib}");

    let first = Verdict(api.call_start_unkeyed(&mut store, ib, 1, 0, 0, 10, 0, 0, 0).unwrap());
    assert_eq!(first.kind(), Some(VerdictKind::Attempt));
    // The call lives in engine b only.
    let live = |store: &mut wasmtime::Store<()>, e, call| api.engine().call_call_info(store, e, call).unwrap().is_some();
    assert!(live(&mut store, b, 1) && !live(&mut store, a, 1));

    a.resource_drop(&mut store).unwrap();
    let gone = Verdict(api.call_start_unkeyed(&mut store, ia, 2, 0, 0, 20, 0, 0, 0).unwrap());
    assert_eq!(gone.kind(), Some(VerdictKind::Invalid));
    assert_eq!(gone.detail(), InvalidCode::UnknownEngine as u8);
    assert_eq!(Verdict(api.call_start_unkeyed(&mut store, 0, 3, 0, 0, 30, 0, 0, 0).unwrap()).detail(), InvalidCode::UnknownEngine as u8);

    // Ids count up: a new engine does not take a dead engine's id.
    let c = api.engine().call_load(&mut store, DOC, 1).unwrap().unwrap();
    let ic = api.engine().call_id(&mut store, c).unwrap();
    assert!(ic != ia && ic != ib);
    // Settling through start-unkeyed applies the held success to the same engine.
    let next = Verdict(api.call_start_unkeyed(&mut store, ib, 2, 0, 0, 40, 1, 35, 25).unwrap());
    assert_eq!(next.kind(), Some(VerdictKind::Attempt));
    assert!(live(&mut store, b, 2));
    assert!(!live(&mut store, b, 1), "call 1 was settled");
}
