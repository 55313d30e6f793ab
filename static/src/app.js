// Browser entry point: htmx for partial updates, uPlot for live GPU charts, a canvas heatmap
// of the fleet, live alert panels.
import htmx from "htmx.org";
import { mountGpuCharts } from "./gpu-chart.js";
import { wireRequestForm } from "./request-form.js";
import { mountTerminal } from "./terminal.js";
import { mountFleetLive } from "./fleet-live.js";
import { mountHeatmap } from "./heatmap.js";
import { mountAlerts } from "./alerts.js";
import { wireAutosubmit } from "./autosubmit.js";
import { mountBatchOutput } from "./batch-output.js";
import { followSandboxStatus } from "./sandbox-status.js";

window.htmx = htmx;

document.addEventListener("DOMContentLoaded", () => {
  const chart = document.getElementById("gpu-chart");
  if (chart) mountGpuCharts(chart);
  const form = document.querySelector(".request-form");
  if (form) wireRequestForm(form);
  const terminal = document.getElementById("terminal");
  if (terminal) mountTerminal(terminal);
  const fleet = document.querySelector("[data-fleet-live]");
  if (fleet) mountFleetLive(fleet.dataset.fleetLive);
  const heatmap = document.getElementById("heatmap");
  if (heatmap) mountHeatmap(heatmap);
  document.querySelectorAll("[data-alerts]").forEach((panel) => mountAlerts(panel));
  document.querySelectorAll("[data-autosubmit]").forEach((field) => wireAutosubmit(field));
  const output = document.getElementById("batch-output");
  if (output) mountBatchOutput(output);
  const status = document.getElementById("status");
  if (status && status.dataset.ws) followSandboxStatus(status);
});
