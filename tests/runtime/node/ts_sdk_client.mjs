// A third-party MCP client for the runtime's tests: the official TypeScript SDK.
// Usage: node ts_sdk_client.mjs <runtime /mcp URL> [bearer token]
// Lists the tools, spawns two sub-agents, awaits both and prints one JSON object.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const [url, token] = process.argv.slice(2);
const headers = token ? { Authorization: `Bearer ${token}` } : {};
const transport = new StreamableHTTPClientTransport(new URL(url), { requestInit: { headers } });
const client = new Client({ name: "ts-sdk-test-client", version: "1.0.0" });

async function call(name, args) {
  const result = await client.callTool({ name, arguments: args });
  if (result.isError) throw new Error(`${name} failed: ${JSON.stringify(result.content)}`);
  return result.structuredContent ?? JSON.parse(result.content[0].text);
}

await client.connect(transport);
const tools = (await client.listTools()).tools;
const spawned = [];
for (const task of ["first question from TypeScript", "second question from TypeScript"]) {
  spawned.push(await call("spawn", { task, serviceClass: "batch", maxToolCalls: 1 }));
}
const awaited = await call("await", { handles: spawned.map((s) => s.handle), mode: "all", timeout: 30 });
// A wrong argument is a tool execution error (isError), which the model reads.
const refused = await client.callTool({ name: "await", arguments: { handles: ["run-does-not-exist"] } });
const badRequest = { isError: refused.isError ?? false, text: refused.content?.[0]?.text ?? "" };
console.log(JSON.stringify({
  server: client.getServerVersion(),
  protocolVersion: transport.protocolVersion ?? null,
  tools: tools.map((t) => ({ name: t.name, required: t.inputSchema.required ?? [] })),
  spawned,
  awaited,
  badRequest,
}));
await client.close();
