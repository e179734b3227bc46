// Command gomodproxy lays out one version of a Go module as a module proxy on disk: the files
// of the GOPROXY protocol (`@v/list`, `.info`, `.mod`, `.zip` in the module zip format), so that
// `GOPROXY=file://DIR go get MODULE@VERSION` fetches it as it would from a real proxy, checksums
// and all (`go get` verifies the zip's hash into go.sum).
//
//	gomodproxy -module DIR -version vX.Y.Z -out PROXY_DIR [-time RFC3339]
//
// The zip is made by golang.org/x/mod/zip from DIR, which must hold only the files to publish
// (release/dist.sh passes a copy of the module's tracked files); subdirectories with their own
// go.mod are other modules and left out, as the go command does.
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/mod/modfile"
	"golang.org/x/mod/module"
	"golang.org/x/mod/semver"
	"golang.org/x/mod/zip"
)

func main() {
	dir := flag.String("module", "", "the module's directory (holding go.mod)")
	version := flag.String("version", "", "the version to publish, vX.Y.Z")
	out := flag.String("out", "", "the proxy directory to write into")
	stamp := flag.String("time", "", "the version's time (RFC 3339; default: now)")
	flag.Parse()
	if *dir == "" || *version == "" || *out == "" || flag.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "usage: gomodproxy -module DIR -version vX.Y.Z -out PROXY_DIR [-time RFC3339]")
		os.Exit(2)
	}
	if err := run(*dir, *version, *out, *stamp); err != nil {
		fmt.Fprintln(os.Stderr, "gomodproxy:", err)
		os.Exit(1)
	}
}

func run(dir, version, out, stamp string) error {
	if !semver.IsValid(version) || semver.Canonical(version) != version {
		return fmt.Errorf("%q is not a canonical semantic version (vX.Y.Z)", version)
	}
	gomod, err := os.ReadFile(filepath.Join(dir, "go.mod"))
	if err != nil {
		return err
	}
	path := modfile.ModulePath(gomod)
	if path == "" {
		return fmt.Errorf("%s/go.mod has no module line", dir)
	}
	mv := module.Version{Path: path, Version: version}
	if err := module.Check(path, version); err != nil {
		return err
	}
	when := time.Now().UTC()
	if stamp != "" {
		if when, err = time.Parse(time.RFC3339, stamp); err != nil {
			return fmt.Errorf("-time: %w", err)
		}
	}
	escaped, err := module.EscapePath(path)
	if err != nil {
		return err
	}
	vdir := filepath.Join(out, filepath.FromSlash(escaped), "@v")
	if err := os.MkdirAll(vdir, 0o755); err != nil {
		return err
	}
	ev, err := module.EscapeVersion(version)
	if err != nil {
		return err
	}
	var zbuf bytes.Buffer
	if err := zip.CreateFromDir(&zbuf, mv, dir); err != nil {
		return fmt.Errorf("making the module zip: %w", err)
	}
	info, err := json.Marshal(struct {
		Version string
		Time    string
	}{version, when.Format(time.RFC3339)})
	if err != nil {
		return err
	}
	for name, data := range map[string][]byte{ev + ".zip": zbuf.Bytes(), ev + ".mod": gomod, ev + ".info": info} {
		if err := os.WriteFile(filepath.Join(vdir, name), data, 0o644); err != nil {
			return err
		}
	}
	listFile := filepath.Join(vdir, "list")
	var versions []string
	if old, err := os.ReadFile(listFile); err == nil {
		versions = strings.Fields(string(old))
	}
	if !slices.Contains(versions, version) {
		versions = append(versions, version)
	}
	semver.Sort(versions)
	if err := os.WriteFile(listFile, []byte(strings.Join(versions, "\n")+"\n"), 0o644); err != nil {
		return err
	}
	fmt.Printf("gomodproxy: %s@%s -> %s (%d bytes zipped)\n", path, version, vdir, zbuf.Len())
	return nil
}
