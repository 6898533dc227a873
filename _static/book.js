// The book's own script: a scroll hint on wide tables and printed tables, code and printed
// lines that wrap on a phone with a hanging indent, and accessibility fixes for HTML that the
// Sphinx extensions and the theme write. Checked by tests/test_browser.py (axe-core).
"use strict";

(function () {
  var chinese = /^zh/i.test(document.documentElement.lang || "");

  // A box wider than the screen: mark it, let a keyboard scroll it (a scrollable box must be
  // focusable, and named) and put a visible hint above ``anchor``; undo all that when the box
  // fits again. A tabindex the theme gave the box itself stays.
  function markScrollable(box, anchor, label, hintText) {
    var hint = anchor.previousElementSibling;
    var hasHint = hint && hint.classList.contains("book-scroll-hint");
    var scrollable = box.scrollWidth > box.clientWidth + 1;
    box.classList.toggle("is-scrollable", scrollable);
    if (scrollable) {
      if (!box.hasAttribute("tabindex")) {
        box.setAttribute("tabindex", "0");
        box.setAttribute("data-book-tabindex", "");
      }
      box.setAttribute("role", "region");
      box.setAttribute("aria-label", label);
      if (!hasHint) {
        hint = document.createElement("p");
        hint.className = "book-scroll-hint";
        hint.setAttribute("aria-hidden", "true");
        hint.textContent = hintText;
        anchor.parentNode.insertBefore(hint, anchor);
      }
    } else {
      if (box.hasAttribute("data-book-tabindex")) {
        box.removeAttribute("tabindex");
        box.removeAttribute("data-book-tabindex");
      }
      box.removeAttribute("role");
      box.removeAttribute("aria-label");
      if (hasHint) hint.remove();
    }
  }

  // Wide tables: say that they scroll sideways. Re-checked when the window changes size.
  function markScrollableTables() {
    document.querySelectorAll(".pst-scrollable-table-container").forEach(function (box) {
      markScrollable(
        box,
        box,
        chinese ? "表格，可左右滚动" : "Table, scrolls sideways",
        chinese
          ? "表格较宽：左右滚动可查看全部 \u2192"
          : "Wide table: scroll sideways to see all of it \u2192"
      );
    });
  }

  // On a phone or a tablet (below 960 px, as in book.css) code and printed lines wrap instead of
  // running off the right edge. Each line of a block becomes a box of its own whose wrapped
  // part hangs two columns right of the line's own indentation, and a line may break after
  // ".", "(", "[" and "," (an empty <wbr>), so that a long dotted name breaks between its parts
  // rather than mid-word. The text stays the same (the copy button copies it unchanged). Printed
  // output whose lines are aligned in columns (a table) keeps its columns: when it is wider than
  // the screen it scrolls in its box, under a hint that says so.
  var NARROW = "(max-width: 959.98px)";
  var COLUMNS = /\S {2,}\S/;
  var BREAK_AFTER = /([.(\[,])/;

  function isPrintedTable(pre) {
    var aligned = pre.textContent.split("\n").filter(function (line) {
      return COLUMNS.test(line);
    });
    return aligned.length >= 2;
  }

  function textWithBreaks(text) {
    var frag = document.createDocumentFragment();
    text.split(BREAK_AFTER).forEach(function (part) {
      if (!part) return;
      frag.appendChild(document.createTextNode(part));
      if (BREAK_AFTER.test(part)) frag.appendChild(document.createElement("wbr"));
    });
    return frag;
  }

  function hangLines(pre) {
    var lines = [[]];
    (function walk(node, chain) {
      node.childNodes.forEach(function (child) {
        if (child.nodeType === Node.TEXT_NODE) {
          child.data.split("\n").forEach(function (part, i) {
            if (i > 0) lines.push([]);
            if (part) lines[lines.length - 1].push({ text: part, chain: chain });
          });
        } else if (child.nodeType === Node.ELEMENT_NODE) {
          walk(child, chain.concat([child]));
        }
      });
    })(pre, []);
    var frag = document.createDocumentFragment();
    lines.forEach(function (line, i) {
      if (i > 0) frag.appendChild(document.createTextNode("\n"));
      if (!line.length) return;
      var text = line.map(function (seg) { return seg.text; }).join("");
      var box = document.createElement("span");
      box.className = "book-line";
      box.style.setProperty("--lead", String(text.length - text.replace(/^ +/, "").length));
      line.forEach(function (seg) {
        var target = box;
        seg.chain.forEach(function (el) {
          target = target.appendChild(el.cloneNode(false));
        });
        target.appendChild(textWithBreaks(seg.text));
      });
      frag.appendChild(box);
    });
    pre.replaceChildren(frag);
    pre.classList.add("book-wraps");
  }

  function wrapLines() {
    if (!window.matchMedia || !window.matchMedia(NARROW).matches) return;
    document.querySelectorAll("article div.highlight pre").forEach(function (pre) {
      if (pre.classList.contains("book-wraps")) return;
      if (pre.closest(".cell_output") && isPrintedTable(pre)) {
        pre.classList.add("book-printed-table");
        return;
      }
      hangLines(pre);
    });
  }

  // A printed table wider than its box: the same hint, above its output.
  function markScrollableOutputs() {
    document.querySelectorAll("pre.book-printed-table").forEach(function (pre) {
      markScrollable(
        pre,
        pre.closest("div.output") || pre.parentNode,
        chinese ? "输出，可左右滚动" : "Output, scrolls sideways",
        chinese
          ? "输出较宽：左右滚动可查看全部 \u2192"
          : "Wide output: scroll sideways to see all of it \u2192"
      );
    });
  }

  function fixAria() {
    // docutils writes the bibliography as <div role="list"> of <div role="doc-biblioentry">.
    // DPUB-ARIA 1.1 deprecates doc-biblioentry in favour of listitem, and axe-core does not
    // accept it as a list item (critical: aria-required-children).
    document.querySelectorAll('[role="list"] > [role="doc-biblioentry"]').forEach(function (el) {
      el.setAttribute("role", "listitem");
    });
    // myst-nb names the "Show code cell source" toggle "Toggle hidden content", a name that
    // does not contain its visible text (WCAG 2.5.3, label in name). Its visible text names it.
    document.querySelectorAll('summary[aria-label="Toggle hidden content"]').forEach(function (el) {
      el.removeAttribute("aria-label");
    });
    // The sidebar's toggle that shows a chapter's sections is an empty <summary> (an icon only):
    // it has no accessible name (axe-core: summary-name). Name it after its chapter's link.
    // sphinx-book-theme writes the sidebar toggles' titles in English, untranslated, and
    // sphinx-togglebutton names a solution's chevron button in English.
    if (chinese) {
      document.querySelectorAll('.toggle-button[aria-label="Toggle hidden content"]').forEach(
        function (el) {
          el.setAttribute("aria-label", "显示/隐藏内容");
        }
      );
      document.querySelectorAll(".primary-toggle, .secondary-toggle").forEach(function (el) {
        var primary = el.classList.contains("primary-toggle");
        var name = primary ? "显示/隐藏侧边栏" : "显示/隐藏页内目录";
        // Bootstrap's tooltip may have taken the title already (into data-bs-original-title, its
        // own content, and the button's aria-label): then each of those is changed instead.
        var tip = window.bootstrap && bootstrap.Tooltip && bootstrap.Tooltip.getInstance(el);
        if (tip && tip.setContent) tip.setContent({ ".tooltip-inner": name });
        if (el.hasAttribute("data-bs-original-title")) {
          el.setAttribute("data-bs-original-title", name);
        } else {
          el.setAttribute("title", name);
        }
        if (el.hasAttribute("aria-label")) el.setAttribute("aria-label", name);
      });
    }
    document.querySelectorAll(".has-children > details > summary").forEach(function (el) {
      if (el.getAttribute("aria-label")) return;
      var item = el.parentElement.parentElement;
      var link = Array.prototype.find.call(item.children, function (child) {
        return child.tagName === "A";
      });
      var title = link ? link.textContent.replace(/\s+/g, " ").trim() : "";
      el.setAttribute(
        "aria-label",
        chinese ? "显示/隐藏“" + title + "”的各节" : "Show/hide sections of " + title
      );
    });
  }

  // A solution's title bar ("Solution to Exercise 3.1 (...)") opens and closes the solution
  // (sphinx-togglebutton listens on the whole bar), but sphinx-exercise makes most of it a link
  // back to the exercise: a tap there jumped away and left the solution closed. The exercise
  // stands just above; the title becomes plain text, so the whole bar opens the solution.
  function solutionTitlesToggle() {
    document.querySelectorAll(".solution > .admonition-title > a.reference").forEach(function (a) {
      var text = document.createElement("span");
      text.className = "solution-title-text";
      text.textContent = a.textContent;
      a.replaceWith(text);
    });
  }

  // A code block that scrolls sideways must be reachable from the keyboard (WCAG 2.1.1).
  // The theme gives such blocks tabindex="0" once, at page load (the others get "-1"); a block
  // inside a folded solution has no width then, so it is handled here when it becomes visible
  // and overflows.
  function focusableCodeBlocks(entries) {
    entries.forEach(function (entry) {
      var pre = entry.target;
      if (pre.scrollWidth > pre.clientWidth + 1 && pre.tabIndex < 0) {
        pre.setAttribute("tabindex", "0");
      }
    });
  }

  // Search results: Sphinx's snippet is the text of the page's [role="main"], which begins with
  // the article header's buttons (".ipynb .pdf ... Contents"). The snippet comes from the
  // article instead (searchtools.js defines Search on the search page only).
  function articleSnippets() {
    if (typeof Search === "undefined" || !Search.htmlToText) return;
    var fallback = Search.htmlToText;
    Search.htmlToText = function (htmlString, anchor) {
      var doc = new DOMParser().parseFromString(htmlString, "text/html");
      var article = doc.querySelector('[role="main"] article');
      if (!article) return fallback(htmlString, anchor);
      article.querySelectorAll(".headerlink, script, style").forEach(function (el) {
        el.remove();
      });
      var part = null;
      try {
        part = anchor ? article.querySelector(anchor) : null;
      } catch (e) {
        part = null; // an anchor that is not a valid selector: the whole article
      }
      return (part || article).textContent;
    };
  }

  function init() {
    articleSnippets();
    fixAria();
    solutionTitlesToggle();
    wrapLines();
    markScrollableTables();
    markScrollableOutputs();
    if (window.ResizeObserver) {
      var preObserver = new ResizeObserver(focusableCodeBlocks);
      document.querySelectorAll("article pre").forEach(function (pre) {
        preObserver.observe(pre);
      });
    }
    // Re-check whenever a table or its box changes size: on resize, and when MathJax typesets
    // the math in a table after this script ran.
    if (window.ResizeObserver) {
      var observer = new ResizeObserver(markScrollableTables);
      document.querySelectorAll(".pst-scrollable-table-container").forEach(function (box) {
        observer.observe(box);
        if (box.firstElementChild) observer.observe(box.firstElementChild);
      });
      // A printed table is re-checked too (one in a folded solution has no width until opened).
      var outputObserver = new ResizeObserver(markScrollableOutputs);
      document.querySelectorAll("pre.book-printed-table").forEach(function (pre) {
        outputObserver.observe(pre);
      });
    } else {
      window.addEventListener("resize", markScrollableTables);
      window.addEventListener("resize", markScrollableOutputs);
    }
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", init);
  } else {
    init();
  }
})();
