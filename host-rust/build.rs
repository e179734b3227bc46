//! Build the policy component (zero imports) so that the crate carries it: a user writes a
//! policy file and never builds Wasm by hand.
fn main() {
    if std::env::var_os("CARGO_FEATURE_WASM").is_none() {
        return;
    }
    for path in levee_build::sources() {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    if let Err(e) = levee_build::build(&out) {
        println!("cargo:warning=levee-build: {e}");
        std::process::exit(1);
    }
}
