package durable

import (
	"embed"
	"fmt"
	"regexp"
	"strings"
)

// The shared statements of docs/durable.md, embedded: sql/*.sql are byte-identical copies of
// the repository's durable/sqlite.sql and durable/postgres.sql (a test fails when they are
// not), so that the module builds from its own folder with no step.
//
//go:embed sql/sqlite.sql sql/postgres.sql
var sqlFiles embed.FS

var nameLine = regexp.MustCompile(`(?m)^-- name: `)

// Statements returns the shared statements of a dialect ("sqlite" or "postgres"), by name,
// as every host executes them: a statement starts at its `-- name:` line and ends at the next.
func Statements(dialect string) (map[string]string, error) {
	text, err := sqlFiles.ReadFile("sql/" + dialect + ".sql")
	if err != nil {
		return nil, fmt.Errorf("levee durable: no statements for dialect %q", dialect)
	}
	return parseStatements(string(text)), nil
}

func parseStatements(text string) map[string]string {
	out := map[string]string{}
	blocks := nameLine.Split(text, -1)
	for _, block := range blocks[1:] {
		name, body, _ := strings.Cut(block, "\n")
		out[strings.TrimSpace(name)] = strings.TrimSpace(body)
	}
	return out
}
