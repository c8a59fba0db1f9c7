// MathJax for pymdownx.arithmatex (generic mode), as the Material for MkDocs docs set it up.
window.MathJax = {
  tex: { inlineMath: [["\\(", "\\)"]], displayMath: [["\\[", "\\]"]], processEscapes: true, processEnvironments: true },
  options: { ignoreHtmlClass: ".*|", processHtmlClass: "arithmatex" },
};
// MathJax itself comes from unpkg.com (mkdocs.yml): where it cannot load (no network, a blocked
// CDN) the formulas stay as TeX, without a TypeError on every page.
document$.subscribe(() => { if (MathJax.typesetPromise) MathJax.typesetPromise(); });
