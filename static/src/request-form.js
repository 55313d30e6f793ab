// Shows only the request-form fields that apply to the chosen tier's sharing mode.
const FIELDS_BY_MODE = {
  dedicated: ["gpu_count"],
  mig: ["mig_profile"],
  mps: ["mps_memory_gib", "mps_thread_pct"],
  timeslice: [],
  cpu: [], // CPU only: no GPU, so no GPU count, MIG profile or MPS share to ask for
};
const MODE_FIELDS = ["gpu_count", "mig_profile", "mps_memory_gib", "mps_thread_pct"];

export function wireRequestForm(form) {
  const modes = JSON.parse(document.getElementById("tier-modes")?.textContent || "{}");
  const tier = form.querySelector("[name=tier]");
  if (!tier) return;
  const apply = () => {
    const wanted = FIELDS_BY_MODE[modes[tier.value]] || MODE_FIELDS;
    for (const name of MODE_FIELDS) {
      const box = form.querySelector(`[data-field=${name}]`);
      if (box) box.hidden = !wanted.includes(name);
    }
  };
  tier.addEventListener("change", apply);
  apply();
  // The command is asked for batch runs only.
  const run = form.querySelector("[name=run]");
  const command = form.querySelector("[data-field=command]");
  if (run && command) {
    const showCommand = () => { command.hidden = run.value !== "batch"; };
    run.addEventListener("change", showCommand);
    showCommand();
  }
}
