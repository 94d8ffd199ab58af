// Copies the front-end libraries the pages use from node_modules (installed by `npm ci` from
// package-lock.json) into dist/vendor/, which the platform serves at /admin/assets/vendor/.
// dist/ is built output and is not committed.
import { copyFileSync, mkdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = dirname(fileURLToPath(import.meta.url));
const vendor = join(root, "dist", "vendor");
const files = [
  ["node_modules/chart.js/dist/chart.umd.min.js", "chart.umd.min.js"],
];

mkdirSync(vendor, { recursive: true });
for (const [src, dest] of files) {
  copyFileSync(join(root, src), join(vendor, dest));
  console.log(`admin_ui: ${src} -> dist/vendor/${dest}`);
}
