// A third-party MCP client that answers elicitations: the official TypeScript SDK.
// Usage: node ts_elicitation_client.mjs <runtime /mcp URL> <allow: true|false>
// Declares elicitation, calls `run` for a sub-agent that deletes a note (destructive,
// so it needs approval), answers each approval form with `allow`, and prints one JSON
// object: the run's record and the forms it was shown.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { ElicitRequestSchema } from "@modelcontextprotocol/sdk/types.js";

const [url, allow] = process.argv.slice(2);
const transport = new StreamableHTTPClientTransport(new URL(url));
const client = new Client(
  { name: "ts-elicitation-client", version: "1.0.0" },
  { capabilities: { elicitation: { form: {} } } },
);
const forms = [];
client.setRequestHandler(ElicitRequestSchema, async (request) => {
  forms.push({ message: request.params.message, requestedSchema: request.params.requestedSchema });
  return { action: "accept", content: { allow: allow === "true" } };
});

await client.connect(transport);
const result = await client.callTool(
  { name: "run", arguments: { task: "delete a note from TypeScript", tools: ["delete_note"], maxToolCalls: 1 } },
  undefined,
  { timeout: 50000 },
);
if (result.isError) throw new Error(`run failed: ${JSON.stringify(result.content)}`);
console.log(JSON.stringify({
  protocolVersion: transport.protocolVersion ?? null,
  node: process.version,
  record: result.structuredContent ?? JSON.parse(result.content[0].text),
  forms,
}));
await client.close();
