// Validates Prometheus-operator custom resources (monitoring.coreos.com/*: ServiceMonitor, PodMonitor,
// PrometheusRule, ...) found in Kubernetes YAML files. kubernetes-validate only warns about CRDs, so
// these need a validator generated from the CRD schemas themselves:
//
//   1. @kubernetes-models/prometheus-operator's `new Kind(obj).validate()`: the CRD's OpenAPI schema
//      (required fields, types, enums, patterns such as Prometheus durations).
//   2. The same package's TypeScript interfaces, type-checked with `tsc --strict`: an object literal
//      with a key the interface does not declare is an error, which catches misspelt or misplaced
//      fields that step 1 lets through (the CRD schemas do not forbid unknown properties; the API
//      server would silently prune them).
//
// Usage: node validate-crds.mjs [--min N] FILE.yaml...
// Prints one line per resource; exits 1 if any resource is invalid, if a monitoring.coreos.com kind has
// no model, or if fewer than N resources were checked (so an empty input cannot pass).

import { readFileSync } from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import ts from "typescript";
import { parseAllDocuments } from "yaml";

const GROUP = "monitoring.coreos.com";
const here = path.dirname(fileURLToPath(import.meta.url));

function parseArgs(argv) {
  let min = 1;
  const files = [];
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === "--min") min = Number(argv[++i]);
    else files.push(argv[i]);
  }
  if (!Number.isInteger(min) || min < 0 || files.length === 0) {
    console.error("usage: node validate-crds.mjs [--min N] FILE.yaml...");
    process.exit(2);
  }
  return { min, files };
}

function loadResources(files) {
  const found = [];
  for (const file of files) {
    const docs = parseAllDocuments(readFileSync(file, "utf8"));
    for (const [index, doc] of docs.entries()) {
      if (doc.errors.length > 0) throw new Error(`${file}: YAML error: ${doc.errors[0].message}`);
      const obj = doc.toJS();
      if (obj && typeof obj.apiVersion === "string" && obj.apiVersion.startsWith(`${GROUP}/`)) {
        found.push({ file, index, obj });
      }
    }
  }
  return found;
}

async function schemaCheck(obj) {
  const version = obj.apiVersion.split("/")[1];
  let mod;
  try {
    mod = await import(`@kubernetes-models/prometheus-operator/${GROUP}/${version}/${obj.kind}`);
  } catch {
    return [`no model for ${obj.apiVersion} ${obj.kind}`];
  }
  const Model = mod[obj.kind];
  try {
    new Model(obj).validate();
    return [];
  } catch (err) {
    return [String(err.message ?? err)];
  }
}

// Type-checks every resource as an object literal of its interface, in one in-memory program whose
// virtual source files live in this folder so that node_modules resolves.
function typeCheck(resources) {
  const sources = new Map();
  resources.forEach((r, i) => {
    const version = r.obj.apiVersion.split("/")[1];
    const file = path.join(here, `__resource_${i}.ts`);
    const text =
      `import type { I${r.obj.kind} } from ` +
      `"@kubernetes-models/prometheus-operator/${GROUP}/${version}/${r.obj.kind}";\n` +
      `export const resource: I${r.obj.kind} = ${JSON.stringify(r.obj, null, 2)};\n`;
    sources.set(file, text);
  });
  const options = {
    strict: true,
    noEmit: true,
    target: ts.ScriptTarget.ES2022,
    module: ts.ModuleKind.Node16,
    moduleResolution: ts.ModuleResolutionKind.Node16,
    skipLibCheck: true,
    types: [],
  };
  const host = ts.createCompilerHost(options);
  const { getSourceFile, fileExists, readFile } = host;
  host.fileExists = (f) => sources.has(f) || fileExists.call(host, f);
  host.readFile = (f) => sources.get(f) ?? readFile.call(host, f);
  host.getSourceFile = (f, lang, onError, create) =>
    sources.has(f)
      ? ts.createSourceFile(f, sources.get(f), lang, true)
      : getSourceFile.call(host, f, lang, onError, create);
  const program = ts.createProgram([...sources.keys()], options, host);
  const errors = new Map();
  for (const d of ts.getPreEmitDiagnostics(program)) {
    const key = d.file ? d.file.fileName : "(program)";
    const msg = ts.flattenDiagnosticMessageText(d.messageText, " ");
    const where = d.file && d.start !== undefined ? d.file.getLineAndCharacterOfPosition(d.start) : null;
    const text = where ? `line ${where.line + 1}: ${msg}` : msg;
    if (!errors.has(key)) errors.set(key, []);
    errors.get(key).push(text);
  }
  return resources.map((_, i) => errors.get(path.join(here, `__resource_${i}.ts`)) ?? []);
}

const { min, files } = parseArgs(process.argv.slice(2));
let resources;
try {
  resources = loadResources(files);
} catch (err) {
  console.error(`FAIL ${err.message}`);
  process.exit(1);
}

let failed = 0;
const typeErrors = typeCheck(resources);
for (const [i, r] of resources.entries()) {
  const name = `${r.obj.kind}/${r.obj.metadata?.name ?? "?"} (${r.file}#${r.index})`;
  const problems = [...(await schemaCheck(r.obj)), ...typeErrors[i].map((e) => `type: ${e}`)];
  if (problems.length === 0) {
    console.log(`ok   ${name}`);
  } else {
    failed++;
    console.log(`FAIL ${name}`);
    for (const p of problems) console.log(`     ${p}`);
  }
}
if (resources.length < min) {
  console.log(`FAIL expected at least ${min} ${GROUP} resource(s), found ${resources.length}`);
  failed++;
}
process.exit(failed === 0 ? 0 : 1);
