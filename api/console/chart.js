// A small line chart on a canvas: time on x (the history so far, at most the last `windowS` seconds and at least
// `minSpanS`), one or more series on y with a shared scale from zero, a legend, and gaps where a value is missing
// (null). No library: a few dozen lines.

const COLORS = ["#2b6cb0", "#dd6b20", "#38a169", "#805ad5"];

export class LineChart {
  constructor(canvas, { series, unit = "", windowS = 600, minSpanS = 60 }) {
    this.canvas = canvas;
    this.series = series;  // [{label, value: (point) => number|null}]
    this.unit = unit;
    this.windowS = windowS;
    this.minSpanS = minSpanS;
  }

  draw(points) {
    const { canvas } = this;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 340;
    const height = canvas.clientHeight || 180;
    canvas.width = width * ratio;
    canvas.height = height * ratio;
    const g = canvas.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, width, height);
    const pad = { left: 48, right: 8, top: 22, bottom: 20 };
    const now = points.length ? points[points.length - 1].at : Date.now() / 1000;
    const oldest = points.length ? points[0].at : now;
    const spanS = Math.min(this.windowS, Math.max(this.minSpanS, now - oldest));
    const start = now - spanS;
    const values = points.flatMap((p) => this.series.map((s) => s.value(p))).filter((v) => v !== null);
    const top = niceCeiling(Math.max(0, ...values));
    const x = (t) => pad.left + ((t - start) / spanS) * (width - pad.left - pad.right);
    const y = (v) => height - pad.bottom - (v / top) * (height - pad.top - pad.bottom);

    g.font = "11px system-ui, sans-serif";
    g.strokeStyle = "#e2e8f0";
    g.fillStyle = "#718096";
    for (let i = 0; i <= 4; i += 1) {
      const v = (top * i) / 4;
      g.beginPath(); g.moveTo(pad.left, y(v)); g.lineTo(width - pad.right, y(v)); g.stroke();
      g.fillText(`${format(v)}${this.unit}`, 2, y(v) + 4);
    }
    g.fillText(spanS >= 120 ? `-${Math.round(spanS / 60)} min` : `-${Math.round(spanS)} s`, pad.left, height - 4);
    g.fillText("now", width - pad.right - 22, height - 4);

    this.series.forEach((s, i) => {
      g.strokeStyle = COLORS[i % COLORS.length];
      g.fillStyle = g.strokeStyle;
      g.lineWidth = 1.5;
      g.beginPath();
      let drawing = false;
      for (const p of points) {
        const v = s.value(p);
        if (v === null || p.at < start) { drawing = false; continue; }
        if (drawing) g.lineTo(x(p.at), y(v)); else g.moveTo(x(p.at), y(v));
        drawing = true;
      }
      g.stroke();
      for (const p of points) {  // dots too: a value between two gaps (a latency seen once) has no line
        const v = s.value(p);
        if (v !== null && p.at >= start) g.fillRect(x(p.at) - 1.5, y(v) - 1.5, 3, 3);
      }
      g.fillRect(pad.left + i * 110, 6, 10, 3);
      g.fillText(s.label, pad.left + i * 110 + 14, 11);
    });
  }
}

function niceCeiling(value) {
  if (value <= 0) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) if (step * power >= value) return step * power;
  return 10 * power;
}

function format(value) {
  return value >= 100 || Number.isInteger(value) ? String(Math.round(value)) : value.toFixed(value < 1 ? 2 : 1);
}
