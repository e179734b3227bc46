//! Build the Levee policy component.
//!
//! 1. `cargo build -p levee-component --target wasm32-unknown-unknown --profile wasm` in a
//!    target directory of its own (so that it can run from a build script without waiting on
//!    the outer build's lock);
//! 2. encode the core module as a component with `wit-component` (no `wasm-tools` install);
//! 3. check that the component has **zero imports**;
//! 4. write `levee_policy.wasm` (the component) and `levee_policy_core.wasm` (the core module
//!    inside it, which the Go host runs on wazero).
//!
//! The build is reproducible: the same sources and toolchain give the same bytes wherever the
//! checkout and `CARGO_HOME` are. The profile strips symbols and custom sections (no
//! `producers` section is left in the core module), workspace paths are relative already, and
//! the paths of registry sources (which panic locations embed) are remapped from `CARGO_HOME`
//! to `/cargo`. `levee-build --source DIR --target-dir DIR OUT` builds another checkout in
//! another target directory, which is how CI checks that two builds agree.

use std::path::{Path, PathBuf};
use std::process::Command;

/// File name of the component.
pub const COMPONENT_FILE: &str = "levee_policy.wasm";
/// File name of the core module.
pub const CORE_FILE: &str = "levee_policy_core.wasm";

/// What a build produced.
#[derive(Debug, Clone)]
pub struct Artifacts {
    /// The component.
    pub component: PathBuf,
    /// The core module.
    pub core: PathBuf,
    /// Component size in bytes.
    pub component_bytes: usize,
}

/// The workspace root (this crate lives at `policy-core/builder`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("..")
}

/// Files whose change must rebuild the component (for `cargo:rerun-if-changed`).
pub fn sources() -> Vec<PathBuf> {
    let root = workspace_root();
    vec![
        root.join("wit"),
        root.join("policy-core/src"),
        root.join("policy-core/component/src"),
        root.join("policy-core/Cargo.toml"),
        root.join("policy-core/component/Cargo.toml"),
        // The `wasm` profile lives in the workspace manifest.
        root.join("Cargo.toml"),
    ]
}

/// Build the component of this workspace into `out_dir`.
pub fn build(out_dir: &Path) -> Result<Artifacts, String> {
    let root = workspace_root();
    let target_dir = root.join("target").join("levee-wasm");
    build_from(&root, &target_dir, out_dir)
}

/// `CARGO_HOME` as cargo resolves it: the variable, else `~/.cargo`.
fn cargo_home() -> Option<PathBuf> {
    std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .map(|p| p.canonicalize().unwrap_or(p))
}

/// Build the component of the workspace at `root` into `out_dir`, compiling in `target_dir`.
pub fn build_from(root: &Path, target_dir: &Path, out_dir: &Path) -> Result<Artifacts, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root)
        .args(["build", "--quiet", "-p", "levee-component", "--target", "wasm32-unknown-unknown", "--profile", "wasm", "--target-dir"])
        .arg(target_dir);
    // A build script's environment describes the outer build; none of it applies here.
    for var in [
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_MAKEFLAGS",
        "MAKEFLAGS",
        "MFLAGS",
    ] {
        cmd.env_remove(var);
    }
    // The profile optimises for size (`opt-level = "z"`, the component's 400 KiB budget), whose
    // inliner leaves the hot path as a chain of tiny calls. A threshold of 40 (z's is 5, s's
    // 50) inlines those: the guest's part of a first-time success drops from about 2,400 to
    // 2,000 instructions in wasmtime, for 2 KB (measured with host-rust/examples/hotloop).
    let mut flags = vec!["-Cllvm-args=-inline-threshold=40".to_string()];
    // Registry sources live under CARGO_HOME, whose path would otherwise end up in panic
    // locations inside the module (workspace paths are relative already).
    if let Some(home) = cargo_home() {
        flags.push(format!("--remap-path-prefix={}=/cargo", home.display()));
    }
    cmd.env("CARGO_ENCODED_RUSTFLAGS", flags.join("\u{1f}"));
    for (var, _) in std::env::vars() {
        if var.starts_with("CARGO_FEATURE_")
            || var.starts_with("CARGO_CFG_")
            || var.starts_with("DEP_")
            || var == "TARGET"
            || var == "HOST"
            || var == "OUT_DIR"
            || var == "PROFILE"
            || var == "OPT_LEVEL"
            || var == "DEBUG"
            || var == "NUM_JOBS"
        {
            cmd.env_remove(var);
        }
    }
    let status = cmd.status().map_err(|e| format!("could not run cargo: {e}"))?;
    if !status.success() {
        return Err(format!(
            "building levee-component for wasm32-unknown-unknown failed ({status}); is the target installed? `rustup target add wasm32-unknown-unknown`"
        ));
    }
    let core_path = target_dir.join("wasm32-unknown-unknown").join("wasm").join("levee_component.wasm");
    let core = std::fs::read(&core_path).map_err(|e| format!("reading {}: {e}", core_path.display()))?;
    let component = encode(&core)?;
    let imports = count_imports(&component)?;
    if imports != 0 {
        return Err(format!("the component has {imports} imports; it must have none"));
    }
    std::fs::create_dir_all(out_dir).map_err(|e| format!("creating {}: {e}", out_dir.display()))?;
    let component_path = out_dir.join(COMPONENT_FILE);
    let core_out = out_dir.join(CORE_FILE);
    write_if_changed(&component_path, &component)?;
    write_if_changed(&core_out, &core)?;
    Ok(Artifacts { component: component_path, core: core_out, component_bytes: component.len() })
}

fn write_if_changed(path: &Path, bytes: &[u8]) -> Result<(), String> {
    if std::fs::read(path).ok().as_deref() == Some(bytes) {
        return Ok(());
    }
    std::fs::write(path, bytes).map_err(|e| format!("writing {}: {e}", path.display()))
}

/// Encode a core module carrying wit-bindgen's component-type section as a component.
pub fn encode(core: &[u8]) -> Result<Vec<u8>, String> {
    wit_component::ComponentEncoder::default()
        .module(core)
        .map_err(|e| format!("reading the core module: {e:#}"))?
        .validate(true)
        .encode()
        .map_err(|e| format!("encoding the component: {e:#}"))
}

/// Number of imports of a component (top level).
pub fn count_imports(component: &[u8]) -> Result<usize, String> {
    let mut depth = 0usize;
    let mut imports = 0usize;
    for payload in wasmparser::Parser::new(0).parse_all(component) {
        match payload.map_err(|e| format!("parsing the component: {e}"))? {
            wasmparser::Payload::ModuleSection { .. } | wasmparser::Payload::ComponentSection { .. } => depth += 1,
            wasmparser::Payload::End(_) => depth = depth.saturating_sub(1),
            wasmparser::Payload::ComponentImportSection(reader) if depth == 0 => imports += reader.count() as usize,
            _ => {}
        }
    }
    Ok(imports)
}
