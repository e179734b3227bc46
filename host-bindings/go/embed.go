//go:build !levee_noembed

package levee

import _ "embed"

// embeddedCore is the core module of the Levee component (levee_policy_core.wasm).
// The file is generated and committed, so that the module builds from its source tree
// with no build step: `./dev go-core` regenerates it and CI fails when it is not
// byte-identical to a fresh (reproducible) build. Build with -tags levee_noembed to
// leave it out and pass the module with WithCoreModule.
//
//go:embed levee_policy_core.wasm
var embeddedCore []byte
