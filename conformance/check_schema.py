#!/usr/bin/env python3
"""Validate every vector in conformance/vectors against conformance/schema.json."""

import glob
import json
import os
import sys

import jsonschema

here = os.path.dirname(os.path.abspath(__file__))
schema = json.load(open(os.path.join(here, "schema.json")))
validator = jsonschema.Draft202012Validator(schema)
files = sorted(glob.glob(os.path.join(here, "vectors", "*.json")))
bad = 0
for path in files:
    vector = json.load(open(path))
    for error in validator.iter_errors(vector):
        bad += 1
        print(f"{os.path.basename(path)}: {'/'.join(map(str, error.path))}: {error.message}", file=sys.stderr)
    if vector.get("name") != os.path.basename(path)[:-5]:
        bad += 1
        print(f"{os.path.basename(path)}: name must equal the file name", file=sys.stderr)
print(f"schema: {len(files)} vectors checked, {bad} problems")
sys.exit(1 if bad or len(files) < 100 else 0)
