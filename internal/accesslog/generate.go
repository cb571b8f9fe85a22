package accesslog

import (
	"container/heap"
	"io"
	"math"
	"math/rand/v2"
	"sort"
	"strconv"
	"time"
)

// Day is a generated stretch of an API's access log, the same for the same
// fields: tenants calling with an API key (X-Api-Key, and an Authorization
// header that the log shows as Caddy does, REDACTED), more of them by day
// than by night, a few far busier than the rest; and on top of that the
// traffic that limits are for:
//
//   - a noisy neighbour, NoisyKey, calling steadily three times a second
//     from 08:00 to 20:00;
//   - a burst, BurstKey sending 300 requests in the 5 seconds from 09:00;
//   - a scraper without an API key, ScraperIP, 20 requests a second for
//     the two minutes from 14:00.
//
// Requests are GET /v1/items (most), POST /v1/chat (X-Max-Tokens asked,
// X-Usage-Tokens in the response, seconds long), POST /v1/login (401 for
// a third) and GET /v1/export (up to 20 s long).
type Day struct {
	Start    time.Time     // the first instant (the special traffic is at its hours)
	Length   time.Duration // default 24h
	Requests int           // about how many regular requests; default 200,000
	Tenants  int           // API keys; default 500
	Seed     uint64
}

// The special traffic's identities.
const (
	NoisyKey  = "ak_noisy"
	BurstKey  = "ak_burst"
	ScraperIP = "203.0.113.66"
)

// Special traffic's times, from Day.Start.
const (
	NoisyFrom   = 8 * time.Hour
	NoisyUntil  = 20 * time.Hour
	BurstAt     = 9 * time.Hour
	ScraperFrom = 14 * time.Hour
	ScraperFor  = 2 * time.Minute
)

func (d Day) withDefaults() Day {
	if d.Length <= 0 {
		d.Length = 24 * time.Hour
	}
	if d.Requests <= 0 {
		d.Requests = 200_000
	}
	if d.Tenants <= 0 {
		d.Tenants = 500
	}
	return d
}

// diurnal is the relative rate at a time of day: a night floor and a
// working-day plateau.
func diurnal(t time.Duration) float64 {
	h := math.Mod(t.Hours(), 24)
	switch {
	case h < 6 || h >= 22:
		return 0.2
	case h < 9:
		return 0.2 + 0.8*(h-6)/3
	case h < 18:
		return 1
	default:
		return 1 - 0.8*(h-18)/4
	}
}

// Each calls fn with each entry of the day in the order Caddy writes them
// (by the end of each request); fn may keep nothing of e past its return.
func (d Day) Each(fn func(e *Entry) error) error {
	d = d.withDefaults()
	rng := rand.New(rand.NewPCG(d.Seed, d.Seed^0x9e3779b97f4a7c15))
	g := &generator{rng: rng, start: d.Start.UnixMicro()}
	// Tenants' shares: Zipf-like, the first few far busier.
	g.cum = make([]float64, d.Tenants)
	total := 0.0
	for i := range g.cum {
		total += 1 / math.Pow(float64(i+1), 1.1)
		g.cum[i] = total
	}
	seconds := int(d.Length / time.Second)
	weight := 0.0
	for s := range seconds {
		weight += diurnal(time.Duration(s) * time.Second)
	}
	perWeight := float64(d.Requests) / weight
	var pending endHeap
	flushUntil := func(t int64) error {
		for len(pending) > 0 && pending[0].End <= t {
			e := heap.Pop(&pending).(*Entry)
			if err := fn(e); err != nil {
				return err
			}
			g.free = append(g.free, e)
		}
		return nil
	}
	for s := range seconds {
		at := time.Duration(s) * time.Second
		n := perWeight * diurnal(at)
		count := int(n)
		if rng.Float64() < n-float64(count) {
			count++
		}
		for range count {
			g.tenantRequest(at, &pending)
		}
		if at >= NoisyFrom && at < NoisyUntil {
			for i := range 3 {
				g.keyed(NoisyKey, -1, at+time.Duration(i)*time.Second/3+time.Duration(rng.IntN(1000))*time.Microsecond, &pending)
			}
		}
		// The burst and the scraper are a little irregular, as clients are:
		// on an exact grid, their requests would land on the instants a
		// bucket's tokens come back (1/60 s divides 600 ms), where which
		// request gets the token is a matter of microseconds.
		if at >= BurstAt && at < BurstAt+5*time.Second {
			for i := range 60 {
				g.keyed(BurstKey, -2, at+time.Duration(i)*time.Second/60+time.Duration(rng.IntN(4000))*time.Microsecond, &pending)
			}
		}
		if at >= ScraperFrom && at < ScraperFrom+ScraperFor {
			for i := range 20 {
				g.scraper(at+time.Duration(i)*time.Second/20+time.Duration(rng.IntN(10000))*time.Microsecond, &pending)
			}
		}
		// Requests are at most 20 s long: those done before this second's
		// requests can begin are written.
		if err := flushUntil(g.start + int64((at-21*time.Second)/time.Microsecond)); err != nil {
			return err
		}
	}
	return flushUntil(math.MaxInt64)
}

type generator struct {
	rng   *rand.Rand
	start int64
	cum   []float64
	free  []*Entry
}

func (g *generator) entry() *Entry {
	if n := len(g.free); n > 0 {
		e := g.free[n-1]
		g.free = g.free[:n-1]
		clear(e.Header)
		clear(e.RespHeader)
		return e
	}
	return &Entry{Header: map[string][]string{}, RespHeader: map[string][]string{}}
}

// tenantRequest adds a regular request in the second at.
func (g *generator) tenantRequest(at time.Duration, pending *endHeap) {
	i := sort.SearchFloat64s(g.cum, g.rng.Float64()*g.cum[len(g.cum)-1])
	key := "ak_" + strconv.Itoa(i+1)
	g.keyed(key, i, at+time.Duration(g.rng.IntN(1_000_000))*time.Microsecond, pending)
}

// keyed adds a request of the tenant with key (its index i for its
// address; negative for the special ones) starting at at.
func (g *generator) keyed(key string, i int, at time.Duration, pending *endHeap) {
	e := g.entry()
	e.Start = g.start + int64(at/time.Microsecond)
	e.Host, e.Proto, e.TLS = "api.example.com", "HTTP/2.0", true
	e.Header["X-Api-Key"] = []string{key}
	e.Header["Authorization"] = []string{Redacted}
	e.Header["User-Agent"] = []string{"example-sdk/1.4"}
	if i < 0 {
		i = 100_000 - i
	}
	e.RemoteIP = "10." + strconv.Itoa(i>>16&255) + "." + strconv.Itoa(i>>8&255) + "." + strconv.Itoa(i&255)
	e.ClientIP, e.RemotePort = e.RemoteIP, strconv.Itoa(30000+g.rng.IntN(30000))
	e.UserID = ""
	g.route(e)
	heap.Push(pending, e)
}

// scraper adds a request of the scraper, starting at at.
func (g *generator) scraper(at time.Duration, pending *endHeap) {
	e := g.entry()
	e.Start = g.start + int64(at/time.Microsecond)
	e.Host, e.Proto, e.TLS = "api.example.com", "HTTP/1.1", true
	e.Header["User-Agent"] = []string{"python-requests/2.31"}
	e.RemoteIP, e.ClientIP, e.RemotePort = ScraperIP, ScraperIP, strconv.Itoa(40000+g.rng.IntN(20000))
	e.UserID = ""
	e.Method, e.URI, e.Status = "GET", "/v1/items?page="+strconv.Itoa(1+g.rng.IntN(500)), 200
	e.End = e.Start + 5000 + int64(g.rng.IntN(40000))
	e.RespHeader["Content-Type"] = []string{"application/json"}
	heap.Push(pending, e)
}

// route gives e a route, a status and a duration.
func (g *generator) route(e *Entry) {
	r := g.rng.Float64()
	e.RespHeader["Content-Type"] = []string{"application/json"}
	switch {
	case r < 0.70:
		e.Method, e.URI, e.Status = "GET", "/v1/items?page="+strconv.Itoa(1+g.rng.IntN(50)), 200
		e.End = e.Start + 5000 + int64(g.rng.IntN(55000))
	case r < 0.85:
		e.Method, e.URI, e.Status = "POST", "/v1/chat", 200
		e.Header["X-Max-Tokens"] = []string{"4000"}
		e.Header["Content-Type"] = []string{"application/json"}
		e.RespHeader["X-Usage-Tokens"] = []string{strconv.Itoa(50 + g.rng.IntN(2950))}
		e.End = e.Start + 300_000 + int64(g.rng.IntN(4_700_000))
	case r < 0.95:
		e.Method, e.URI, e.Status = "POST", "/v1/login", 200
		if g.rng.IntN(3) == 0 {
			e.Status = 401
		}
		e.End = e.Start + 20_000 + int64(g.rng.IntN(60_000))
	default:
		e.Method, e.URI, e.Status = "GET", "/v1/export", 200
		e.RespHeader["Content-Type"] = []string{"text/csv"}
		e.End = e.Start + 1_000_000 + int64(g.rng.IntN(19_000_000))
	}
}

// endHeap orders entries by their end, as Caddy writes them.
type endHeap []*Entry

func (h endHeap) Len() int { return len(h) }
func (h endHeap) Less(i, j int) bool {
	if h[i].End != h[j].End {
		return h[i].End < h[j].End
	}
	return h[i].Start < h[j].Start
}
func (h endHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *endHeap) Push(x any)   { *h = append(*h, x.(*Entry)) }
func (h *endHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}

// WriteTo writes the day as Caddy's JSON access log lines.
func (d Day) WriteTo(w io.Writer) (int64, error) {
	var buf []byte
	var n int64
	err := d.Each(func(e *Entry) error {
		buf = AppendJSON(buf[:0], e)
		m, err := w.Write(buf)
		n += int64(m)
		return err
	})
	return n, err
}
