/*
 * build.mjs: the console's production build, offline: esbuild bundles
 * src/main.tsx with React into dist/app.js and the form library into a
 * chunk that app.js loads when a page shows a form (dist/chunk-*.js), and
 * copies index.html and the style sheet; nothing is fetched at run time
 * (no CDN, no web font).  Run by insight/tuvl on first use and by
 * test/run's console suite: node build.mjs
 */
import { build } from "esbuild";
import { copyFileSync, mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { basename, dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const out = join(here, "dist");
rmSync(out, { recursive: true, force: true });
mkdirSync(out, { recursive: true });
const built = await build({
    entryPoints: [join(here, "src", "main.tsx")],
    bundle: true,
    minify: true,
    sourcemap: false,
    format: "esm",
    /* the form library in a chunk of its own, loaded by the pages that show a form */
    splitting: true,
    chunkNames: "chunk-[hash]",
    entryNames: "app",
    target: ["es2022"],
    jsx: "automatic",
    define: { "process.env.NODE_ENV": '"production"' },
    outdir: out,
    logLevel: "warning",
    legalComments: "linked",
    metafile: true,
});
/* the chunks app.js imports, asked for with it (not after it has been read) */
const app = Object.entries(built.metafile.outputs).find(([, o]) => o.entryPoint)?.[1];
const preload = (app?.imports ?? []).filter((i) => i.kind === "import-statement")
    .map((i) => `<link rel="modulepreload" href="/console/${basename(i.path)}">\n`).join("");
writeFileSync(join(out, "index.html"),
              readFileSync(join(here, "src", "index.html"), "utf8").replace(/(<script type="module")/, `${preload}$1`));
copyFileSync(join(here, "src", "style.css"), join(out, "style.css"));
copyFileSync(join(here, "src", "favicon.svg"), join(out, "favicon.svg"));
