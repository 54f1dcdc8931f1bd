// errands dashboard: the only script besides htmx. No inline scripts (the CSP forbids them).
document.addEventListener("change", function (event) {
  var box = event.target;
  var group = box && box.getAttribute && box.getAttribute("data-select-all");
  if (!group) return;
  var form = box.closest("form") || document;
  form.querySelectorAll('input[type="checkbox"][name="' + group + '"]').forEach(function (item) {
    item.checked = box.checked;
  });
});
// Keep live regions still while the user is selecting or typing inside them.
document.addEventListener("htmx:before:request", function (event) {
  var elt = event.target;
  if (elt && elt.id === "live" && elt.contains(document.activeElement) &&
      document.activeElement !== document.body) {
    event.preventDefault();
  }
});
