// TokenReduce front-end extension. Acts only on this pack's node types.
import { app } from "../../scripts/app.js";

const OUR_NODES = new Set(["TokenReduceToMe", "TokenReduceToDo"]);

app.registerExtension({
  name: "TokenReduce.NodeInfo",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!OUR_NODES.has(nodeData.name)) return;
    // After a run, show the node's report (what it patched, warnings) as its title tooltip.
    const previous = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      previous?.apply(this, arguments);
      const text = message?.text?.join("\n");
      if (text) this.tokenreduceInfo = text;
    };
  },
});
