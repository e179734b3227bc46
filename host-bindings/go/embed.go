//go:build !levee_noembed

package levee

import _ "embed"

// embeddedCore is the core module of the Levee component (levee_policy_core.wasm),
// copied here by ci.sh from $LEVEE_WASM_DIR. Build with -tags levee_noembed to
// leave it out and pass the module with WithCoreModule.
//
//go:embed levee_policy_core.wasm
var embeddedCore []byte
