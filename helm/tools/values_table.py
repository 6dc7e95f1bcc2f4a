"""Print the README values table from helm/stagecast/values.yaml (`# --` comments).

python helm/tools/values_table.py   # paste below "## Values" in helm/stagecast/README.md
"""

import json
import re
from pathlib import Path

import yaml

src = (Path(__file__).resolve().parents[1] / "stagecast" / "values.yaml").read_text().splitlines()
vals = yaml.safe_load("\n".join(src))
stack = []  # (indent, key)
desc = None
rows = []
for line in src:
    s = line.strip()
    if s.startswith("# --"):
        desc = [s[4:].strip()]
        continue
    if s.startswith("#"):
        if desc is not None:
            desc.append(s[1:].strip())
        continue
    m = re.match(r"^(\s*)([A-Za-z0-9_]+):", line)
    if not m:
        continue
    ind = len(m.group(1))
    key = m.group(2)
    while stack and stack[-1][0] >= ind:
        stack.pop()
    stack.append((ind, key))
    if desc is not None:
        path = ".".join(k for _, k in stack)
        node = vals
        for k in path.split("."):
            node = node[k]
        d = json.dumps(node, separators=(", ", ": "))
        if len(d) > 60:
            d = "see values.yaml"
        rows.append((path, " ".join(desc).replace("|", "\\|"), d.replace("|", "\\|")))
        desc = None
print("| Key | Description | Default |")
print("| --- | --- | --- |")
for p, d, v in rows:
    print(f"| `{p}` | {d} | `{v}` |")
