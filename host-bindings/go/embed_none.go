//go:build levee_noembed

package levee

// embeddedCore is empty in a levee_noembed build: pass the core module with WithCoreModule.
var embeddedCore []byte
