package levee

// Version is the version of this module's release (the module is tagged
// host-bindings/go/vVERSION). It is the version of every Levee package of the same
// release; release/version.py keeps them equal.
const Version = "0.1.0"
