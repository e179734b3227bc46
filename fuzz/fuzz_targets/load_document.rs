//! Any document text: an engine or a list of errors with paths, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        match levee_core::Engine::load(text, 0) {
            Ok(engine) => {
                for i in 0..engine.policy_count() {
                    let _ = engine.policy_json(i);
                    let _ = engine.analyze(i, 3);
                }
            }
            Err(errors) => assert!(!errors.is_empty()),
        }
    }
});
