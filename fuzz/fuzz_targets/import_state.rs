//! Any state bytes: imported, or refused with nothing changed.
#![no_main]
use libfuzzer_sys::fuzz_target;

const DOC: &str = "policies:\n  p: { breaker: {}, rate-limit: { rate: 5 }, budget: { kind: ratio } }\n  q: { budget: { kind: token } }\n";

fuzz_target!(|data: &[u8]| {
    let Ok(mut engine) = levee_core::Engine::load(DOC, 1) else { return };
    let before = engine.export_state();
    if engine.import_state(data).is_err() {
        assert_eq!(before, engine.export_state());
    } else {
        // What was imported exports and imports again.
        let again = engine.export_state();
        assert!(engine.import_state(&again).is_ok());
    }
});
