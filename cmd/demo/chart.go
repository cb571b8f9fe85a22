package main

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
)

// writeChart draws, as a hand-written SVG, the requests admitted in each
// second of the inbound runs, one line per store, against the budget (the
// burst and the rate in the first second, the rate after it). It returns
// the file's absolute path.
func writeChart(runs ...inbound) (string, error) {
	const (
		width, height            = 820, 420
		left, right, top, bottom = 70, 250, 60, 60
		plotW, plotH             = width - left - right, height - top - bottom
	)
	seconds := len(runs[0].perSecond)
	budget := make([]float64, seconds)
	for i := range budget {
		budget[i] = inRate
	}
	budget[0] += inBurst

	top1 := float64(inRate + inBurst)
	for _, r := range runs {
		for _, c := range r.perSecond {
			top1 = math.Max(top1, float64(c))
		}
	}
	step := 10.0
	for _, s := range []float64{10, 20, 25, 50, 100, 200, 250, 500, 1000} {
		step = s
		if top1/s <= 7 {
			break
		}
	}
	yMax := math.Ceil(top1*1.05/step) * step
	x := func(sec float64) float64 { return left + sec/float64(seconds)*plotW }
	y := func(v float64) float64 { return top + plotH - v/yMax*plotH }

	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="13">`+"\n", width, height, width, height)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", width, height)
	fmt.Fprintf(&b, `<text x="%d" y="22" font-size="16" font-weight="bold">Admitted requests per second: %d Caddy instances, one API key</text>`+"\n", left, fleetSize)
	fmt.Fprintf(&b, `<text x="%d" y="40" fill="#555">In-process, each instance has its own bucket: %d instances admit %d budgets. Redis: one shared bucket.</text>`+"\n", left, fleetSize, fleetSize)
	// Grid and axes.
	for v := 0.0; v <= yMax+1e-9; v += step {
		fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#e4e4e4"/>`+"\n", left, y(v), left+plotW, y(v))
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%g</text>`+"\n", left-8, y(v)+4, v)
	}
	for s := 0; s <= seconds; s++ {
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#e4e4e4"/>`+"\n", x(float64(s)), top, x(float64(s)), top+plotH)
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">%d</text>`+"\n", x(float64(s)), top+plotH+18, s)
	}
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", left, top+plotH, left+plotW, top+plotH)
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", left, top, left, top+plotH)
	fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="middle">seconds since the load began (%d requests/s sent, round-robin)</text>`+"\n", left+plotW/2, height-16, inOffered)
	fmt.Fprintf(&b, `<text transform="translate(20 %d) rotate(-90)" text-anchor="middle">requests admitted in that second</text>`+"\n", top+plotH/2)

	// One step line per series: the count holds over its whole second.
	steps := func(vals []float64) string {
		var p []string
		for i, v := range vals {
			p = append(p, fmt.Sprintf("%.1f,%.1f %.1f,%.1f", x(float64(i)), y(v), x(float64(i+1)), y(v)))
		}
		return strings.Join(p, " ")
	}
	type line struct {
		label, color, dash string
		vals               []float64
	}
	var lines []line
	colors := map[string]string{"in-process": "#d62728", "Redis": "#1f77b4"}
	for _, r := range runs {
		vals := make([]float64, len(r.perSecond))
		for i, c := range r.perSecond {
			vals[i] = float64(c)
		}
		label := fmt.Sprintf("%s store: %.0f/s", r.store, r.steady())
		if r.store == "Redis" {
			label = fmt.Sprintf("Redis store (shared): %.0f/s", r.steady())
		}
		lines = append(lines, line{label, colors[r.store], "", vals})
	}
	// The budget last, so that it shows over a line that follows it.
	lines = append(lines, line{fmt.Sprintf("budget: %d/s (+ burst %d)", inRate, inBurst), "#222222", `stroke-dasharray="7 5"`, budget})
	for i, l := range lines {
		w := 3
		if l.dash != "" {
			w = 2
		}
		fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="%d" %s points="%s"/>`+"\n", l.color, w, l.dash, steps(l.vals))
		// The legend, right of the plot.
		ly := top + 20 + 26*i
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="%d" %s/>`+"\n", left+plotW+14, ly, left+plotW+40, ly, l.color, w, l.dash)
		fmt.Fprintf(&b, `<text x="%d" y="%d">%s</text>`+"\n", left+plotW+46, ly+4, l.label)
	}
	b.WriteString("</svg>\n")

	if err := os.MkdirAll(outputDir, 0o755); err != nil {
		return "", err
	}
	path, err := filepath.Abs(filepath.Join(outputDir, chartFile))
	if err != nil {
		return "", err
	}
	return path, os.WriteFile(path, []byte(b.String()), 0o644)
}
