// A live line chart in SVG: the last N samples, scaled to their maximum. Small on
// purpose: one series, no library.
"use strict";

class LiveChart {
  constructor(svg, { points = 120, width = 600, height = 140, unit = "" } = {}) {
    this.svg = svg;
    this.points = points;
    this.w = width;
    this.h = height;
    this.unit = unit;
    this.values = [];
  }

  push(v) {
    this.values.push(Math.max(0, v || 0));
    if (this.values.length > this.points) this.values.shift();
    this.draw();
  }

  draw() {
    const ns = "http://www.w3.org/2000/svg";
    const top = 16;
    const bottom = this.h - 4;
    const max = Math.max(1, ...this.values);
    const step = this.w / (this.points - 1);
    const offset = this.points - this.values.length;
    const xy = this.values.map((v, i) => [
      (offset + i) * step, bottom - (v / max) * (bottom - top)]);
    const path = xy.map(([x, y], i) => (i ? "L" : "M") + x.toFixed(1) + " " + y.toFixed(1))
      .join(" ");
    const node = (tag, attrs, text) => {
      const n = document.createElementNS(ns, tag);
      for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
      if (text !== undefined) n.textContent = text;
      return n;
    };
    const last = this.values.length ? this.values[this.values.length - 1] : 0;
    const children = [
      node("line", { class: "axis", x1: 0, y1: bottom, x2: this.w, y2: bottom }),
      node("text", { x: 4, y: 12 }, `max ${max.toFixed(1)}${this.unit}`),
      node("text", { x: this.w - 4, y: 12, "text-anchor": "end" },
        `now ${last.toFixed(1)}${this.unit}`),
    ];
    if (xy.length > 1) {
      const first = xy[0][0].toFixed(1);
      const end = xy[xy.length - 1][0].toFixed(1);
      children.push(node("path", { class: "area", d: `${path} L${end} ${bottom} L${first} ${bottom} Z` }));
      children.push(node("path", { class: "line", d: path }));
    }
    this.svg.replaceChildren(...children);
  }
}
