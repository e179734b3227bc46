//! Put the policy component into OUT_DIR, where `src/raw.rs` embeds it: a user writes a policy
//! file and never builds Wasm. No nested cargo build: the component is an input, found in order
//!
//! 1. `$LEVEE_WASM_DIR/levee_policy.wasm` when the variable is set (the justfile and the hosts'
//!    ci.sh set it to the workspace's fresh build, `target/levee`);
//! 2. `wasm/levee_policy.wasm` in this crate: the prebuilt component a packaged crate ships
//!    (`./dev dist` copies it there for `cargo package`);
//! 3. `../target/levee/levee_policy.wasm`: a plain `cargo build` in the workspace after
//!    `./dev component`.
//!
//! The file must be a component (the Wasm magic and the component layer), or the build stops
//! and says where it looked.
use std::path::{Path, PathBuf};

const FILE: &str = "levee_policy.wasm";
/// `\0asm`, then version 0x0d and layer 1: a component, not a core module.
const COMPONENT_HEADER: [u8; 8] = [0x00, 0x61, 0x73, 0x6d, 0x0d, 0x00, 0x01, 0x00];

fn main() {
    println!("cargo:rerun-if-env-changed=LEVEE_WASM_DIR");
    if std::env::var_os("CARGO_FEATURE_WASM").is_none() {
        return;
    }
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let mut candidates = Vec::new();
    if let Some(dir) = std::env::var_os("LEVEE_WASM_DIR").filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        // A relative LEVEE_WASM_DIR is the workspace root's (as in the hosts' ci.sh).
        let dir = if dir.is_relative() { manifest.join("..").join(dir) } else { dir };
        candidates.push(dir.join(FILE));
    }
    let packaged = manifest.join("wasm").join(FILE);
    candidates.push(packaged.clone());
    candidates.push(manifest.join("..").join("target").join("levee").join(FILE));
    // Only the candidates that exist are watched: cargo counts a missing `rerun-if-changed` path
    // as changed on every build, which would rerun this script and rebuild the crate and all that
    // depends on it each time (a packaged crate's `../target/levee`, the repository's `wasm/`).
    // A component that appears later at a missing path is picked up when LEVEE_WASM_DIR or the
    // file in use changes.
    for path in candidates.iter().filter(|p| p.is_file()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    let Some(found) = candidates.iter().find(|p| p.is_file()) else {
        fail(&format!(
            "the policy component is missing; looked at {}. In the Levee repository, build it with `./dev component` \
             (or set LEVEE_WASM_DIR to a directory holding {FILE}); a packaged crate ships it in wasm/.",
            candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        ))
    };
    if found == &packaged && manifest.join("..").join("policy-core").join("component").is_dir() {
        println!("cargo:warning=using {} (left by ./dev dist?); set LEVEE_WASM_DIR to use a fresh build", packaged.display());
    }
    let bytes = std::fs::read(found).unwrap_or_else(|e| fail(&format!("reading {}: {e}", found.display())));
    if !bytes.starts_with(&COMPONENT_HEADER) {
        fail(&format!("{} is not a WebAssembly component (a core module, or not Wasm at all)", found.display()));
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default()).join(FILE);
    write_if_changed(&out, &bytes);
}

fn write_if_changed(path: &Path, bytes: &[u8]) {
    if std::fs::read(path).ok().as_deref() == Some(bytes) {
        return;
    }
    if let Err(e) = std::fs::write(path, bytes) {
        fail(&format!("writing {}: {e}", path.display()));
    }
}

fn fail(msg: &str) -> ! {
    println!("cargo:warning=levee: {msg}");
    eprintln!("levee: {msg}");
    std::process::exit(1)
}
