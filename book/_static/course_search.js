// Search snippets that work offline. On the search page only: load the text of every page
// (written at build time by book/_ext/course_html.py; a script loads from file://, where a fetch
// of the page would be refused) and give each result a snippet around the first search term,
// with the terms highlighted. Sphinx's own snippets, which fetch each page, are switched off.
(function () {
  "use strict";

  const SNIPPET_CONTEXT = 120; // characters shown before the first term (and twice that in all)

  function docName(link) {
    // "book/memory.html#section" (relative to the search page, at the book's root) -> "book/memory"
    return decodeURIComponent(link.getAttribute("href").split("#")[0].split("?")[0]).replace(/\.html$/, "");
  }

  function terms() {
    const query = new URLSearchParams(window.location.search).get("q") || "";
    // Each word of the query, and the parts of a hyphenated one ("all-reduce": also "reduce"),
    // longest first, so that the whole word is marked where it appears.
    const words = query.toLowerCase().split(/\s+/).filter((term) => term.length > 0);
    const parts = words.flatMap((word) => word.split(/[^\p{L}\p{N}]+/u)).filter((part) => part.length > 2);
    return [...new Set([...words, ...parts])].sort((a, b) => b.length - a.length);
  }

  function snippet(text, words) {
    const lower = text.toLowerCase();
    // Around the longest term the page contains ("all-reduce" before "all", which "parallelism" holds).
    const found = words.map((word) => lower.indexOf(word)).filter((at) => at >= 0);
    const at = found.length ? found[0] : 0;
    const start = Math.max(at - SNIPPET_CONTEXT, 0), end = Math.min(start + 2 * SNIPPET_CONTEXT, text.length);
    return (start > 0 ? "…" : "") + text.slice(start, end).trim() + (end < text.length ? "…" : "");
  }

  function highlight(paragraph, words) {
    // The terms, marked as Sphinx marks them (class "highlighted"), without parsing any HTML.
    const text = paragraph.textContent, lower = text.toLowerCase();
    paragraph.replaceChildren();
    let from = 0;
    while (from < text.length) {
      let next = -1, word = "";
      for (const candidate of words) {
        const at = lower.indexOf(candidate, from);
        if (at >= 0 && (next < 0 || at < next)) { next = at; word = candidate; } // longest first wins ties
      }
      if (next < 0) { paragraph.append(text.slice(from)); break; }
      paragraph.append(text.slice(from, next));
      const mark = document.createElement("span");
      mark.className = "highlighted";
      mark.textContent = text.slice(next, next + word.length);
      paragraph.append(mark);
      from = next + word.length;
    }
  }

  function addSnippet(item) {
    const link = item.querySelector("a[href]");
    if (!link || item.querySelector("p.context") || !window.COURSE_SEARCH_TEXT) return;
    const text = window.COURSE_SEARCH_TEXT[docName(link)];
    if (!text) return;
    const paragraph = document.createElement("p");
    paragraph.className = "context";
    paragraph.textContent = snippet(text, terms());
    highlight(paragraph, terms());
    item.appendChild(paragraph);
  }

  function start() {
    const results = document.getElementById("search-results");
    if (!results) return; // not the search page
    const script = document.createElement("script");
    script.src = document.documentElement.dataset.content_root + "_static/course_search_text.js";
    script.onload = () => results.querySelectorAll("ul.search > li").forEach(addSnippet);
    document.head.appendChild(script);
    new MutationObserver((changes) => {
      for (const change of changes)
        for (const node of change.addedNodes)
          if (node.nodeType === 1 && node.matches("ul.search > li")) addSnippet(node);
    }).observe(results, { childList: true, subtree: true });
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
