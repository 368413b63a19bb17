// The colibri-stream dashboard: polls /api/stats every second and draws it. Plain JS, no dependencies.
// Text from the server (session names) only ever goes through textContent, never innerHTML.
"use strict";

const POLL_MS = 1000;
const KEY_ITEM = "colibri-api-key"; // sessionStorage: this tab only
const LABEL_W = 44; // heat map: room for the "L12" row labels, px
const COLD = "#374151"; // an expert never routed to
const GAP = "#1f2937"; // between cells (the card background)
const RAM_MARK = "#22d3ee";
const VRAM_MARK = "#a78bfa";
const PIN_MARK = "#f9fafb";
const WARM_FROM = [150, 30, 20]; // fewest requests (dark red) ...
const WARM_TO = [255, 220, 40]; // ... most requests (yellow)

const $ = (id) => document.getElementById(id);

function formatBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function percent(x) {
  return x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`;
}

function number(x, digits = 1) {
  return x === null || x === undefined ? "–" : x.toFixed(digits);
}

function setText(id, text) {
  $(id).textContent = text;
}

// ------------------------------------------------------------------------------------------ tiers
function drawTiers(tiers) {
  const box = $("tiers");
  box.replaceChildren();
  for (const tier of tiers) {
    const div = document.createElement("div");
    div.className = "tier";
    const title = document.createElement("div");
    title.textContent = `${tier.name.toUpperCase()}: ${formatBytes(tier.used_bytes)} of ` +
      `${formatBytes(tier.budget_bytes)} · ${tier.used_slots}/${tier.slots} slots · hit rate ${percent(tier.hit_rate)}`;
    const bar = document.createElement("div");
    bar.className = "bar";
    const fill = document.createElement("div");
    fill.style.width = `${tier.budget_bytes ? Math.min(100, (100 * tier.used_bytes) / tier.budget_bytes) : 0}%`;
    bar.append(fill);
    div.append(title, bar);
    box.append(div);
  }
  if (!tiers.some((t) => t.name === "vram")) {
    const none = document.createElement("div");
    none.className = "note";
    none.textContent = "VRAM: no budget";
    box.append(none);
  }
}

// ------------------------------------------------------------------------------------- requests
function drawRequests(stats) {
  setText("tok-per-s", number(stats.decode_tok_per_s, 2));
  setText("queue", `${stats.queue.busy}/${stats.queue.slots} · ${stats.queue.queued}`);
  const c = stats.counters;
  setText("counters", `${c.served} / ${c.cancelled} / ${c.failed} / ${c.rejected}`);
  const body = $("active");
  body.replaceChildren();
  for (const job of stats.active) {
    const row = document.createElement("tr");
    const cells = [job.session ?? "–", job.prompt_tokens, `${job.generated_tokens}/${job.max_tokens}`,
      number(job.decode_tok_per_s, 2)];
    for (const value of cells) {
      const td = document.createElement("td");
      td.textContent = String(value);
      row.append(td);
    }
    body.append(row);
  }
}

function drawIo(stats) {
  const io = stats.io;
  setText("window", io.window_s ? `last ${io.window_s.toFixed(1)} s` : "");
  setText("bytes-per-s", io.bytes_read_per_s === null ? "–" : `${formatBytes(io.bytes_read_per_s)}/s`);
  setText("reads-per-s", number(io.reads_per_s, 1));
  setText("io-wait", percent(io.io_wait_fraction));
  setText("hit-recent", percent(io.hit_rate));
  setText("hit-total", percent(stats.experts.hit_rate));
  setText("requests", String(stats.experts.requests));
  drawDevices(stats.devices ?? []);
}

// Per device of a spread container (empty, and hidden, for a whole one).
function drawDevices(devices) {
  $("devices-table").hidden = devices.length === 0;
  const body = $("devices");
  body.replaceChildren();
  for (const d of devices) {
    const row = document.createElement("tr");
    const cells = [d.device, d.reads, formatBytes(d.bytes_read), number(d.busy_s, 2),
      d.mb_per_s === null ? "–" : number(d.mb_per_s, 0), d.fallbacks];
    for (const value of cells) {
      const td = document.createElement("td");
      td.textContent = String(value);
      row.append(td);
    }
    body.append(row);
  }
}

// ------------------------------------------------------------------------------------- heat map
function warm(count, max) {
  const t = Math.log1p(count) / Math.log1p(max);
  const channel = (i) => Math.round(WARM_FROM[i] + t * (WARM_TO[i] - WARM_FROM[i]));
  return `rgb(${channel(0)}, ${channel(1)}, ${channel(2)})`;
}

function cellSize(canvas, nExperts) {
  const room = canvas.parentElement.clientWidth - 24 - LABEL_W;
  return Math.max(3, Math.min(24, Math.floor(room / Math.max(1, nExperts))));
}

function frame(ctx, x, y, size, colour) {
  ctx.strokeStyle = colour;
  ctx.lineWidth = 1;
  ctx.strokeRect(x + 0.5, y + 0.5, size - 2, size - 2); // inside the cell, on whole pixels
}

function drawHeat(stats) {
  const canvas = $("heat");
  const heat = stats.heat;
  const nExperts = heat.length ? heat[0].length : 0;
  const size = cellSize(canvas, nExperts);
  canvas.width = LABEL_W + nExperts * size;
  canvas.height = Math.max(1, heat.length * size);
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = GAP;
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  const max = heat.flat().reduce((a, b) => Math.max(a, b), 1); // no spread: 60 x 384 arguments is too many for some engines
  ctx.font = `${Math.min(12, size)}px system-ui, sans-serif`;
  ctx.textBaseline = "middle";
  heat.forEach((row, r) => {
    const y = r * size;
    const ram = new Set(stats.resident.ram[r]);
    const vram = new Set(stats.resident.vram[r]);
    const pinned = new Set(stats.resident.pinned[r]);
    ctx.fillStyle = "#9ca3af";
    if (size >= 8) ctx.fillText(`L${stats.heat_layers[r]}`, 2, y + size / 2);
    row.forEach((count, e) => {
      const x = LABEL_W + e * size;
      ctx.fillStyle = count ? warm(count, max) : COLD;
      ctx.fillRect(x, y, size - 1, size - 1);
      if (size >= 6 && vram.has(e)) frame(ctx, x, y, size, VRAM_MARK);
      else if (size >= 6 && ram.has(e)) frame(ctx, x, y, size, RAM_MARK);
      if (pinned.has(e)) {
        const dot = Math.max(1, Math.floor(size / 4));
        ctx.fillStyle = PIN_MARK;
        ctx.fillRect(x + Math.floor((size - 1 - dot) / 2), y + Math.floor((size - 1 - dot) / 2), dot, dot);
      }
    });
  });
}

// ------------------------------------------------------------------------------------- polling
function showStatus(text, isError) {
  const status = $("status");
  status.textContent = text;
  status.className = isError ? "error" : "";
}

function askForKey(message) {
  $("key-form").hidden = false;
  showStatus(message, true);
}

async function poll() {
  const key = sessionStorage.getItem(KEY_ITEM);
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  try {
    const reply = await fetch("/api/stats", { headers, cache: "no-store" });
    if (reply.status === 401) {
      if (key) sessionStorage.removeItem(KEY_ITEM);
      askForKey(key ? "the API key was refused" : "API key required");
      return; // polling resumes when a key is entered
    }
    if (!reply.ok) throw new Error(`HTTP ${reply.status}`);
    const stats = await reply.json();
    $("key-form").hidden = true;
    setText("model", stats.model);
    showStatus(`up ${Math.round(stats.uptime_s)} s`, false);
    drawTiers(stats.tiers);
    drawIo(stats);
    drawRequests(stats);
    drawHeat(stats);
  } catch (err) {
    showStatus(`cannot reach the server (${err.message})`, true);
  }
  setTimeout(poll, POLL_MS);
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_ITEM, key);
  $("key").value = "";
  poll();
});

poll();
