// Shows only the request-form fields that apply to the chosen tier's sharing mode.
const FIELDS_BY_MODE = {
  dedicated: ["gpu_model", "gpu_count"],
  mig: ["gpu_model", "mig_profile"],
  mps: ["gpu_model", "mps_memory_gib", "mps_thread_pct"],
  timeslice: ["gpu_model"],
  cpu: [], // CPU only: no GPU, so no GPU model, count, MIG profile or MPS share to ask for
};
const MODE_FIELDS = ["gpu_model", "gpu_count", "mig_profile", "mps_memory_gib", "mps_thread_pct"];

// The GPU model and MIG profile menus list the chosen tier's only (all, for a tier that
// lists none); a pick the tier does not offer goes back to the blank choice ("Any", "—").
function narrowMenu(select, offered) {
  for (const option of select.options) {
    option.hidden = Boolean(offered) && option.value !== "" && !offered.includes(option.value);
  }
  if (select.selectedOptions[0]?.hidden) select.value = "";
}

export function wireRequestForm(form) {
  const modes = JSON.parse(document.getElementById("tier-modes")?.textContent || "{}");
  const menus = JSON.parse(document.getElementById("tier-menus")?.textContent || "{}");
  const profiles = JSON.parse(document.getElementById("tier-profiles")?.textContent || "{}");
  const tier = form.querySelector("[name=tier]");
  if (!tier) return;
  const model = form.querySelector("[name=gpu_model]");
  const profile = form.querySelector("[name=mig_profile]");
  const apply = () => {
    const wanted = FIELDS_BY_MODE[modes[tier.value]] || MODE_FIELDS;
    for (const name of MODE_FIELDS) {
      const box = form.querySelector(`[data-field=${name}]`);
      if (box) box.hidden = !wanted.includes(name);
    }
    if (model && menus[tier.value]) narrowMenu(model, menus[tier.value]);
    if (profile) narrowMenu(profile, profiles[tier.value]);
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
