// Copies uPlot's browser build (and its licence) from node_modules into static/vendor, the folder the
// package ships: `npm ci && npm run build` reproduces the committed files byte for byte.
import { copyFileSync, mkdirSync } from "node:fs";

const files = [
  ["node_modules/uplot/dist/uPlot.iife.min.js", "static/vendor/uPlot.iife.min.js"],
  ["node_modules/uplot/dist/uPlot.min.css", "static/vendor/uPlot.min.css"],
  ["node_modules/uplot/LICENSE", "static/vendor/uPlot.LICENSE"],
];
mkdirSync("static/vendor", { recursive: true });
for (const [from, to] of files) {
  copyFileSync(from, to);
  console.log(`${from} -> ${to}`);
}
