// TokenReduce front-end extension: shows, on each of this pack's patch nodes, what the node did
// in the last run (model, patched levels, tokens before and after, active steps, sampling time)
// and any warning. Acts only on this pack's node types; every hook chains the one it replaces.
//
// Two renderers, one report: on the classic LiteGraph canvas the report is drawn under the node
// (onDrawForeground; the node keeps its size). With "Modern Node Design" (Nodes 2.0,
// Comfy.VueNodes.Enabled) the canvas draws no nodes, so the report is a read-only DOM widget,
// the last one in the node's body: our nodes carry it only while that mode is on, it is empty
// and hidden until there is a report, and it is never saved in the workflow nor sent with the
// prompt.
//
// Data comes from the server, never polled: the node's UI output (sent as `executed` when the
// node runs or is cached) says what it patched; a `tokenreduce.run` message, sent when a sampling
// run with the patched model ends, gives the run's figures; `execution_error` for our node and
// validation errors (app.lastNodeErrors) are shown as warnings.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const OUR_NODES = new Set(["TokenReduceToMe", "TokenReduceToDo", "TokenReduceImageCompare"]);
const SETTING_SHOW = "TokenReduce.Overlay.Show";
const RUN_EVENT = "tokenreduce.run";
const REPORT_WIDGET = "tokenreduce_report"; // the DOM widget that carries the report in Nodes 2.0
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

function setting(id) {
  const settings = app.extensionManager?.setting;
  return settings ? settings.get(id) : app.ui?.settings?.getSettingValue?.(id);
}

function overlayShown() {
  return setting(SETTING_SHOW) !== false;
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
  syncReportWidget(node);
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

// What the report says: the run's lines, then validation errors and the run's warnings.
function reportRows(node) {
  const state = node.tokenreduce;
  const rows = (state?.lines ?? []).map((text) => ({ text, warning: false }));
  for (const warning of [...validationWarnings(node), ...(state?.warnings ?? [])]) {
    rows.push({ text: `⚠ ${warning}`, warning: true });
  }
  return rows;
}

// --- Nodes 2.0 (Vue-rendered nodes): the report as a DOM widget ---------------------------------

// Set by the frontend while nodes are rendered as Vue components (absent before Nodes 2.0).
function vueNodesMode() {
  return globalThis.LiteGraph?.vueNodesMode === true;
}

const withReportWidget = new Set(); // our nodes that carry the report widget now

function reportWidget(node) {
  return node.widgets?.find((w) => w.name === REPORT_WIDGET);
}

function makeReportElement() {
  const element = document.createElement("div");
  element.className = "tokenreduce-report";
  Object.assign(element.style, {
    font: STYLE.font,
    lineHeight: `${STYLE.lineHeight}px`,
    color: STYLE.text,
    background: STYLE.background,
    border: `1px solid ${STYLE.border}`,
    borderRadius: "4px",
    padding: `${STYLE.pad}px`,
    boxSizing: "border-box",
    overflowWrap: "anywhere",
    whiteSpace: "normal",
    userSelect: "text",
    cursor: "auto",
  });
  return element;
}

function addReportWidget(node) {
  if (typeof node.addDOMWidget !== "function") return null;
  const element = makeReportElement();
  const widget = node.addDOMWidget(REPORT_WIDGET, "tokenreduce-report", element, {
    serialize: false, // not in the prompt
    hideOnZoom: false,
    getValue: () => "",
    setValue: () => {},
    getMinHeight: () => 0,
  });
  if (!widget) return null;
  widget.serialize = false; // not in the workflow's widgets_values
  widget.tokenreduceSignature = null;
  withReportWidget.add(node);
  return widget;
}

function removeReportWidget(node) {
  withReportWidget.delete(node);
  const widget = reportWidget(node);
  if (!widget) return;
  if (typeof node.removeWidget === "function") {
    node.removeWidget(widget);
  } else {
    widget.onRemove?.();
    node.widgets.splice(node.widgets.indexOf(widget), 1);
  }
}

function renderReport(widget, rows) {
  const signature = JSON.stringify(rows);
  if (widget.tokenreduceSignature === signature) return;
  widget.tokenreduceSignature = signature;
  const element = widget.element;
  element.replaceChildren(
    ...rows.map((row) => {
      const line = document.createElement("div");
      line.textContent = row.text;
      if (row.warning) {
        line.style.color = STYLE.warning;
        line.title = row.text;
        Object.assign(line.style, {
          display: "-webkit-box",
          webkitBoxOrient: "vertical",
          webkitLineClamp: String(STYLE.maxWarningLines),
          overflow: "hidden",
        });
      }
      return line;
    }),
  );
  element.style.display = rows.length ? "block" : "none";
}

// Nodes 2.0: each of our nodes carries the widget (added when the node is made, or when the mode
// is switched on) and it shows the report, or nothing while there is none or the setting is off.
// Classic canvas: the widget goes away and the overlay draws the report.
function syncReportWidget(node) {
  if (!vueNodesMode()) {
    if (withReportWidget.has(node) || reportWidget(node)) removeReportWidget(node);
    return;
  }
  const widget = reportWidget(node) ?? addReportWidget(node);
  if (widget) renderReport(widget, overlayShown() ? reportRows(node) : []);
}

let syncQueued = false;

// After each canvas frame (drawn in both modes): follows validation errors, the setting and a
// switch between the two renderers. Changes wait until the frame is done.
function queueSync(canvas) {
  if (syncQueued) return;
  const vue = vueNodesMode();
  if (!vue && !withReportWidget.size) return;
  syncQueued = true;
  queueMicrotask(() => {
    syncQueued = false;
    const nodes = vue ? (canvas?.graph?.nodes ?? canvas?.graph?._nodes ?? []) : [...withReportWidget];
    for (const node of nodes) {
      if (OUR_NODES.has(node.comfyClass ?? node.type)) syncReportWidget(node);
    }
  });
}

// --- Nodes 2.0: a node with folded inputs as tall as what it shows ------------------------------
//
// LiteGraph sizes a node from the widgets it shows (its isWidgetVisible reads widget.advanced),
// but the frontend (1.49.6) marks advanced inputs only in widget.options, so a new node gets the
// height of all its inputs; Nodes 2.0 takes that height as the node's least height, and the
// folded inputs leave an empty area. So in Nodes 2.0 our nodes are sized with the folded inputs
// left out: the node is as tall as its content, which grows and shrinks as the user unfolds and
// folds them (the frontend records the size it measures). The classic canvas folds nothing and
// is sized as before. A saved workflow keeps the sizes it was saved with.

const ALWAYS_SHOW_ADVANCED = "Comfy.Node.AlwaysShowAdvancedWidgets";

function foldedInNodes2(node, widget) {
  return widget.options?.advanced === true && !node.showAdvanced && setting(ALWAYS_SHOW_ADVANCED) !== true;
}

// LiteGraph's own computeSize, with the folded widgets marked the way it reads them for the call.
function sizeWithFoldedLeftOut(node, computeSize, args) {
  const marked = (node.widgets ?? []).filter((w) => !w.advanced && foldedInNodes2(node, w));
  for (const widget of marked) widget.advanced = true;
  try {
    return computeSize.apply(node, args);
  } finally {
    for (const widget of marked) widget.advanced = undefined;
  }
}

// --- classic canvas: the overlay under the node --------------------------------------------------

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
    const canvas = app.canvas;
    if (canvas) {
      const onDrawForeground = canvas.onDrawForeground;
      canvas.onDrawForeground = function () {
        const result = onDrawForeground?.apply(this, arguments);
        queueSync(this);
        return result;
      };
    }
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
      // In Nodes 2.0 the report widget is part of the node from the start (the last widget).
      if (vueNodesMode()) syncReportWidget(this);
      return result;
    };

    const computeSize = nodeType.prototype.computeSize;
    nodeType.prototype.computeSize = function () {
      return vueNodesMode() ? sizeWithFoldedLeftOut(this, computeSize, arguments) : computeSize.apply(this, arguments);
    };

    const onRemoved = nodeType.prototype.onRemoved;
    nodeType.prototype.onRemoved = function () {
      const result = onRemoved?.apply(this, arguments);
      withReportWidget.delete(this);
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
