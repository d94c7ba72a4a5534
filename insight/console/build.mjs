/*
 * build.mjs: the console's production build, offline: esbuild bundles
 * src/main.tsx with React and the form library into dist/app.js, and
 * copies index.html and the style sheet; nothing is fetched at run time
 * (no CDN, no web font).  Run by insight/tuvl on first use and by
 * test/run's console suite: node build.mjs
 */
import { build } from "esbuild";
import { copyFileSync, mkdirSync, rmSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const out = join(here, "dist");
rmSync(out, { recursive: true, force: true });
mkdirSync(out, { recursive: true });
await build({
    entryPoints: [join(here, "src", "main.tsx")],
    bundle: true,
    minify: true,
    sourcemap: false,
    format: "esm",
    target: ["es2022"],
    jsx: "automatic",
    define: { "process.env.NODE_ENV": '"production"' },
    outfile: join(out, "app.js"),
    logLevel: "warning",
    legalComments: "linked",
});
copyFileSync(join(here, "src", "index.html"), join(out, "index.html"));
copyFileSync(join(here, "src", "style.css"), join(out, "style.css"));
copyFileSync(join(here, "src", "favicon.svg"), join(out, "favicon.svg"));
