//! Build the policy component so that the runner replays vectors through the real artifact.
fn main() {
    for path in levee_build::sources() {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    if let Err(e) = levee_build::build(&out) {
        println!("cargo:warning=levee-build: {e}");
        std::process::exit(1);
    }
}
