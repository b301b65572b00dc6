// TokenReduce front-end extension: draws, on each of this pack's patch nodes, what the node did
// in the last run (model, patched levels, tokens before and after, active steps, sampling time)
// and any warning. Acts only on this pack's node types; every hook chains the one it replaces.
//
// Data comes from the server, never polled: the node's UI output (sent as `executed` when the
// node runs or is cached) says what it patched; a `tokenreduce.run` message, sent when a sampling
// run with the patched model ends, gives the run's figures; `execution_error` for our node and
// validation errors (app.lastNodeErrors) are shown as warnings.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const OUR_NODES = new Set(["TokenReduceToMe", "TokenReduceToDo"]);
const SETTING_SHOW = "TokenReduce.Overlay.Show";
const RUN_EVENT = "tokenreduce.run";
const STYLE = {
  font: "11px sans-serif",
  lineHeight: 14,
  pad: 5,
  gap: 6, // between the node's bottom edge and the overlay
  text: "#d8d8d8",
  warning: "#f0b429",
  background: "rgba(20, 20, 20, 0.85)",
  border: "rgba(255, 255, 255, 0.15)",
  maxWarningLines: 4,
};

function overlayShown() {
  const settings = app.extensionManager?.setting;
  const value = settings ? settings.get(SETTING_SHOW) : app.ui?.settings?.getSettingValue?.(SETTING_SHOW);
  return value !== false;
}

// Node ids inside subgraphs come as "outer:inner"; walk down from the root graph.
function nodeByExecutionId(id) {
  const path = String(id).split(":");
  let graph = app.graph;
  for (const part of path.slice(0, -1)) {
    graph = graph?.getNodeById(Number(part))?.subgraph;
  }
  const node = graph?.getNodeById(Number(path[path.length - 1]));
  return node && OUR_NODES.has(node.comfyClass ?? node.type) ? node : null;
}

function show(node, lines, warnings) {
  node.tokenreduce = { lines: lines ?? [], warnings: warnings ?? [] };
  node.setDirtyCanvas?.(true, true);
}

// Words of a warning broken to the overlay's width; the last line ends in "…" when cut.
function wrap(ctx, text, width, maxLines) {
  const words = text.split(/\s+/);
  const lines = [];
  let line = "";
  for (const word of words) {
    const candidate = line ? `${line} ${word}` : word;
    if (line && ctx.measureText(candidate).width > width) {
      lines.push(line);
      line = word;
    } else {
      line = candidate;
    }
  }
  if (line) lines.push(line);
  if (lines.length > maxLines) {
    lines.length = maxLines;
    lines[maxLines - 1] += " …";
  }
  return lines;
}

function validationWarnings(node) {
  const errors = app.lastNodeErrors?.[node.id]?.errors ?? [];
  return errors.map((e) => [e.message, e.details].filter(Boolean).join(": "));
}

function drawOverlay(node, ctx) {
  const state = node.tokenreduce;
  const invalid = validationWarnings(node);
  if ((!state && !invalid.length) || node.flags?.collapsed || !overlayShown()) return;
  const width = Math.max(node.size[0], 120);
  ctx.save();
  ctx.font = STYLE.font;
  const rows = (state?.lines ?? []).map((text) => ({ text, color: STYLE.text }));
  for (const warning of [...invalid, ...(state?.warnings ?? [])]) {
    for (const text of wrap(ctx, `⚠ ${warning}`, width - 2 * STYLE.pad, STYLE.maxWarningLines)) {
      rows.push({ text, color: STYLE.warning });
    }
  }
  const textWidth = Math.max(...rows.map((row) => ctx.measureText(row.text).width));
  const boxWidth = Math.max(width, textWidth + 2 * STYLE.pad);
  const top = node.size[1] + STYLE.gap;
  ctx.fillStyle = STYLE.background;
  ctx.strokeStyle = STYLE.border;
  ctx.beginPath();
  ctx.roundRect?.(0, top, boxWidth, rows.length * STYLE.lineHeight + 2 * STYLE.pad, 4);
  ctx.fill();
  ctx.stroke();
  ctx.textBaseline = "top";
  ctx.textAlign = "left";
  rows.forEach((row, i) => {
    ctx.fillStyle = row.color;
    ctx.fillText(row.text, STYLE.pad, top + STYLE.pad + i * STYLE.lineHeight);
  });
  ctx.restore();
}

app.registerExtension({
  name: "TokenReduce.NodeOverlay",
  settings: [
    {
      id: SETTING_SHOW,
      category: ["TokenReduce", "Overlay", "Show"],
      name: "Show what TokenReduce did on its nodes",
      tooltip:
        "After a run, draw under each TokenReduce node the patched levels, tokens before and after, " +
        "the active steps, the sampling time and any warning.",
      type: "boolean",
      defaultValue: true,
      onChange: () => app.graph?.setDirtyCanvas(true, true),
    },
  ],

  async setup() {
    api.addEventListener(RUN_EVENT, ({ detail }) => {
      const node = nodeByExecutionId(detail.node);
      if (node) show(node, detail.lines, detail.warnings);
    });
    api.addEventListener("execution_error", ({ detail }) => {
      if (!OUR_NODES.has(detail?.node_type)) return;
      const node = nodeByExecutionId(detail.node_id);
      if (node) show(node, [], [detail.exception_message]);
    });
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!OUR_NODES.has(nodeData.name)) return;

    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output) {
      onExecuted?.apply(this, arguments);
      const shown = output?.tokenreduce?.[0];
      if (shown) show(this, shown.lines, shown.warnings);
    };

    // The frontend gives ToMe's seed a "control after generate" widget that starts on
    // "randomize": that would change the merge pattern, and the image, on every run. New nodes
    // start on "fixed"; a loaded workflow then sets whatever was saved.
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = onNodeCreated?.apply(this, arguments);
      const control = this.widgets?.find((w) => w.name === "control_after_generate");
      if (control) control.value = "fixed";
      return result;
    };

    const onDrawForeground = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx) {
      const result = onDrawForeground?.apply(this, arguments);
      drawOverlay(this, ctx);
      return result;
    };
  },
});
