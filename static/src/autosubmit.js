// A <select data-autosubmit> submits its form on change (the audit log's filter). Wired here,
// not with an onchange="" attribute, because the Content-Security-Policy forbids inline code.
export function wireAutosubmit(field) {
  field.addEventListener("change", () => field.form?.requestSubmit());
}
