// Search snippets that work offline. On the search page only: load the text of every page
// (written at build time by book/_ext/course_html.py; a script loads from file://, where a fetch
// of the page would be refused) and give each result a snippet: from the section the result links
// to, the window that holds the most of the query, the terms highlighted. Sphinx's own snippets,
// which fetch each page, are switched off.
(function () {
  "use strict";

  const SNIPPET_LENGTH = 240, LEAD = 60; // characters shown, and how many of them before the first term

  function docName(link) {
    // "book/memory.html#section" (relative to the search page, at the book's root) -> "book/memory"
    return decodeURIComponent(link.getAttribute("href").split("#")[0].split("?")[0]).replace(/\.html$/, "");
  }

  function anchor(link) {
    const hash = link.getAttribute("href").split("#")[1];
    return hash ? decodeURIComponent(hash) : null;
  }

  function terms() {
    const query = new URLSearchParams(window.location.search).get("q") || "";
    // Each word of the query, and the parts of a hyphenated one ("all-reduce": also "reduce"),
    // longest first, so that the whole word is marked where it appears.
    const words = query.toLowerCase().split(/\s+/).filter((term) => term.length > 0);
    const parts = words.flatMap((word) => word.split(/[^\p{L}\p{N}]+/u)).filter((part) => part.length > 2);
    return [...new Set([...words, ...parts])].sort((a, b) => b.length - a.length);
  }

  function region(entry, section) {
    // The part of the page a result points to: its section (from where the section begins to where
    // the next one does), or the whole page.
    const starts = Object.values(entry.sections).sort((a, b) => a - b);
    const from = section in entry.sections ? entry.sections[section] : 0;
    const next = starts.find((at) => at > from);
    return section in entry.sections ? [from, next === undefined ? entry.text.length : next] : [0, entry.text.length];
  }

  function snippet(entry, section, words) {
    // The window of the region that holds the most of the query (longer terms weigh more: the
    // whole "zero-3" before its part "zero"), so that the snippet shows the text that matched.
    const text = entry.text, lower = text.toLowerCase();
    const [from, to] = region(entry, section);
    const hits = [];
    for (const word of words)
      for (let at = lower.indexOf(word, from); at >= 0 && at < to; at = lower.indexOf(word, at + 1)) hits.push([at, word]);
    let start = from, best = -1;
    for (const [at] of hits) {
      const windowStart = Math.max(from, at - LEAD), windowEnd = windowStart + SNIPPET_LENGTH;
      const found = new Set(hits.filter(([h, w]) => h >= windowStart && h + w.length <= windowEnd).map(([, w]) => w));
      const score = [...found].reduce((sum, word) => sum + word.length, 0);
      if (score > best || (score === best && windowStart < start)) { best = score; start = windowStart; }
    }
    const end = Math.min(start + SNIPPET_LENGTH, text.length);
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
    const entry = window.COURSE_SEARCH_TEXT[docName(link)];
    if (!entry) return;
    const paragraph = document.createElement("p");
    paragraph.className = "context";
    paragraph.textContent = snippet(entry, anchor(link), terms());
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
