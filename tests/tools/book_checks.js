// The book's page checks, evaluated in the page by tests/test_book_browser.py (and on hand-made pages by
// tests/test_book_checks.py). Returns a list of problems, one sentence each; empty when the page is clean.
async () => {
  const problems = [];
  const LOG_SLACK = 0.5;     // decades a log axis may run past its data (or a tenth of its span)
  const LIN_SLACK = 0.5;     // fraction of the data's span a linear axis may run past it
  const figName = (gd, i) => {
    const t = gd._fullLayout && gd._fullLayout.title && gd._fullLayout.title.text;
    return `figure ${i + 1}` + (t ? ` ("${String(t).replace(/<[^>]+>/g, ' ').slice(0, 60)}")` : '');
  };
  const axisId = name => name[0] + name.slice(5);  // 'xaxis2' -> 'x2', 'yaxis' -> 'y'
  const nums = arr => {
    const out = [];
    if (!arr) return out;
    for (const v of arr) {
      if (Array.isArray(v) || ArrayBuffer.isView(v)) out.push(...nums(v));
      else if (typeof v === 'number' && isFinite(v)) out.push(v);
    }
    return out;
  };
  // [lo, hi] of what is drawn on one axis (visible traces and data-referenced shapes), or null
  function extent(gd, axName, ax) {
    const letter = axName[0], id = axisId(axName);
    let vals = [], traces = 0;
    for (const t of gd._fullData) {
      if (t.visible !== true || !(letter + 'axis' in t) || t[letter + 'axis'] !== id) continue;
      traces += 1;
      if (t.type === 'heatmap') {
        const z = t.z || [];
        const n = letter === 'x' ? (z[0] ? z[0].length : 0) : z.length;
        const coords = t[letter] && t[letter].length ? nums(t[letter]) : null;
        const d = t['d' + letter] === undefined ? 1 : t['d' + letter];
        const o = t[letter + '0'] === undefined ? 0 : t[letter + '0'];
        if (coords && coords.length) vals.push(Math.min(...coords) - d / 2, Math.max(...coords) + d / 2);
        else if (n) vals.push(o - d / 2, o + (n - 0.5) * d);
        continue;
      }
      vals.push(...nums(t[letter]));
      const valueAxis = (t.orientation === 'h') ? 'x' : 'y';
      if (t.type === 'bar' && letter === valueAxis && ax.type !== 'log') vals.push(0);
    }
    // an animation's axes are fixed for all its frames: judge them against the data of every frame
    const frames = (gd._transitionData && gd._transitionData._frames) || [];
    for (const fr of frames) {
      for (const [k, d] of (fr.data || []).entries()) {
        const t = gd._fullData[fr.traces ? fr.traces[k] : k];
        if (!t || t.visible !== true || t[letter + 'axis'] !== id || !d) continue;
        vals.push(...nums(d[letter]));
      }
    }
    for (const s of (gd._fullLayout.shapes || [])) {
      if (s.visible === false) continue;
      if (s[letter + 'ref'] === id) vals.push(...nums([s[letter + '0'], s[letter + '1']]));
    }
    if (ax.type === 'log') vals = vals.filter(v => v > 0);
    if (!vals.length) return traces ? 'no-values' : null;
    return [Math.min(...vals), Math.max(...vals)];
  }
  function textFits(gd) {
    const out = [];
    const width = gd._fullLayout.width;
    for (const sel of ['.g-gtitle text', '.annotation-text-g text', '.legendtext']) {
      for (const el of gd.querySelectorAll(sel)) {
        const box = el.getBoundingClientRect(), host = gd.getBoundingClientRect();
        if (!box.width) continue;
        if (box.left < host.left - 1 || box.right > host.left + width + 1) {
          out.push(`text "${el.textContent.slice(0, 50)}" is cut (${Math.round(box.width)} px wide ` +
                   `in a ${Math.round(width)} px figure)`);
        }
      }
    }
    return out;
  }
  // a dropdown menu must not cover the title (which carries the measured-where-and-when caption) or the legend
  function menusClear(gd) {
    const out = [];
    const hit = (a, b) => a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1;
    const menus = [...gd.querySelectorAll('.updatemenu-header-group')].map(el => el.getBoundingClientRect())
      .filter(r => r.width > 0);
    for (const sel of ['.g-gtitle text', '.legendtext']) {
      for (const el of gd.querySelectorAll(sel)) {
        const box = el.getBoundingClientRect();
        if (box.width && menus.some(m => hit(m, box))) {
          out.push(`a dropdown menu covers the text "${el.textContent.slice(0, 50)}"`);
        }
      }
    }
    return out;
  }
  function checkAxes(gd) {
    const out = [];
    const fl = gd._fullLayout;
    for (const name of Object.keys(fl).filter(k => /^[xy]axis\d*$/.test(k))) {
      const ax = fl[name];
      if (!ax || ax.visible === false) continue;
      const ext = extent(gd, name, ax);
      if (ext === null) continue;  // nothing drawn on this axis
      // the drawn title (an untitled axis has a placeholder in _fullLayout that is never drawn)
      const drawn = gd.querySelector(`.g-${axisId(name)}title text`);
      if (!drawn || !drawn.textContent.trim()) out.push(`${name} has no title`);
      if (ext === 'no-values' || ax.type === 'category' || ax.type === 'date' || !ax.range) continue;
      const lo = Math.min(...ax.range), hi = Math.max(...ax.range);
      if (ax.type === 'log') {
        const dlo = Math.log10(ext[0]), dhi = Math.log10(ext[1]);
        const slack = Math.max(LOG_SLACK, 0.1 * (dhi - dlo));  // autorange pads a wide span a little more
        if (lo < dlo - slack || hi > dhi + slack) {
          out.push(`log ${name} runs 10^${lo.toFixed(1)}..10^${hi.toFixed(1)} around data ` +
                   `${ext[0].toPrecision(3)}..${ext[1].toPrecision(3)}`);
        }
      } else {
        const span = (ext[1] - ext[0]) || Math.abs(ext[1]) || 1;
        if (lo < ext[0] - LIN_SLACK * span || hi > ext[1] + LIN_SLACK * span) {
          out.push(`${name} runs ${lo.toPrecision(3)}..${hi.toPrecision(3)} around data ` +
                   `${ext[0].toPrecision(3)}..${ext[1].toPrecision(3)}`);
        }
      }
    }
    return out;
  }
  const gds = [...document.querySelectorAll('.js-plotly-plot')];
  for (const [i, gd] of gds.entries()) {
    if (!gd._fullLayout || !gd._fullData) continue;
    const label = figName(gd, i);
    const seen = new Set();  // report each problem of a figure once, in the first state that shows it
    const add = (where, msgs) => {
      for (const m of msgs) {
        if (!seen.has(m)) { seen.add(m); problems.push(`${label}${where}: ${m}`); }
      }
    };
    if (gd._fullData.some(t => t.type === 'table')) {
      add('', ['a plotly table (it hides rows that do not fit): use sparseattn.viz.Table']);
    }
    add('', [...checkAxes(gd), ...textFits(gd), ...menusClear(gd)]);
    // every state of a kernel-free explorer: each dropdown option, each slider step
    const states = [];
    for (const [m, menu] of (gd.layout.updatemenus || []).entries()) {
      for (const b of (menu.buttons || [])) states.push([`dropdown ${m + 1} "${b.label}"`, b]);
    }
    for (const [s, slider] of (gd.layout.sliders || []).entries()) {
      for (const st of (slider.steps || [])) states.push([`slider ${s + 1} "${st.label}"`, st]);
    }
    for (const [what, ctl] of states) {
      if (ctl.method !== 'update' && ctl.method !== 'restyle' && ctl.method !== 'relayout') continue;
      try {
        await Plotly[ctl.method](gd, ...(ctl.args || []));
      } catch (e) {
        add(`, ${what}`, [`the control fails (${e})`]);
        continue;
      }
      add(`, ${what}`, [...checkAxes(gd), ...textFits(gd), ...menusClear(gd)]);
    }
    const frames = (gd._transitionData && gd._transitionData._frames) || [];
    if (frames.length) {
      await Plotly.animate(gd, [frames[frames.length - 1].name],
                           {mode: 'immediate', frame: {duration: 0, redraw: true}, transition: {duration: 0}});
      add(', last frame', checkAxes(gd));
    }
  }
  // HTML tables: all rows and columns visible (no clipping or scrolling ancestor)
  for (const [i, table] of [...document.querySelectorAll('article table, .cell_output table')].entries()) {
    const rows = table.querySelectorAll('tr').length;
    for (let el = table.parentElement; el && el.tagName !== 'ARTICLE' && el !== document.body;
         el = el.parentElement) {
      const oy = getComputedStyle(el).overflowY;
      if ((oy === 'auto' || oy === 'scroll' || oy === 'hidden') && el.scrollHeight > el.clientHeight + 2) {
        problems.push(`table ${i + 1} (${rows} rows) is clipped by its container: ${el.scrollHeight} px of ` +
                      `rows in ${el.clientHeight} px`);
        break;
      }
      const ox = getComputedStyle(el).overflowX;
      if ((ox === 'auto' || ox === 'scroll' || ox === 'hidden') && el.scrollWidth > el.clientWidth + 2) {
        problems.push(`table ${i + 1} is wider than its container (${el.scrollWidth} px in ` +
                      `${el.clientWidth} px): columns are cut or scrolled out of sight`);
        break;
      }
    }
  }
  // text outputs and display math fit the page: nothing cut off or scrolled out of sight on the right
  for (const pre of document.querySelectorAll('.cell_output pre')) {
    if (pre.closest('.sa-source')) continue;  // package source scrolls sideways like any code listing
    if (pre.scrollWidth > pre.clientWidth + 2) {
      problems.push(`an output line is cut (${pre.scrollWidth} px in ${pre.clientWidth} px): ` +
                    `"${pre.innerText.split('\n').find(l => l.length > 60) || ''}"`.slice(0, 140));
    }
  }
  for (const eq of document.querySelectorAll('mjx-container[display="true"]')) {
    const host = eq.parentElement.getBoundingClientRect(), box = eq.firstElementChild
      ? eq.firstElementChild.getBoundingClientRect() : eq.getBoundingClientRect();
    if (box.width > host.width + 2) {
      problems.push(`an equation is wider than the page (${Math.round(box.width)} px in ` +
                    `${Math.round(host.width)} px): "${eq.textContent.slice(0, 50)}"`);
    }
  }
  // outputs state results in words: no bare False next to a claim
  for (const out of document.querySelectorAll('.cell_output')) {
    if (out.querySelector('.sa-source')) continue;  // package source shown as code, not a claim
    for (const line of out.innerText.split('\n')) {
      if (/(^|[\s:|,(\[])False($|[\s,.;:)\]])/.test(line) && !/=\s*False/.test(line)) {
        problems.push(`an output prints a bare False: "${line.trim().slice(0, 90)}"`);
      }
    }
  }
  return problems;
}
