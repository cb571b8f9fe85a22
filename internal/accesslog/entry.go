// Package accesslog reads Caddy's JSON access logs (the `http.log.access`
// entries of the `log` directive with the JSON encoder), plain or
// gzip-compressed, one entry a line, and writes generated ones: a day of
// an API's traffic, for the replay's tests and benchmark.
//
// What a line gives is what Caddy logged: the request (method, host, URI,
// headers, the client's address), the response (status, headers) and how
// long it took. Caddy writes the line when the response is done, so its
// `ts` is the end of the request; Start is `ts` less `duration`. Lines of
// releases before v2.5 (`remote_addr` instead of `remote_ip` and
// `remote_port`) and the encoder's other time and duration formats are
// read too.
package accesslog

import (
	"encoding/json"
	"errors"
	"math"
	"net"
	"strconv"
	"strings"
	"time"
)

// Redacted is what Caddy writes in place of the values of the
// Authorization, Proxy-Authorization, Cookie and Set-Cookie headers unless
// the server's logs are told to log credentials.
const Redacted = "REDACTED"

// Entry is one request of an access log.
type Entry struct {
	// Start and End are when the request began and when its response was
	// done (the line's `ts`), in Unix µs.
	Start, End int64
	Method     string
	Host       string
	URI        string // as the client sent it: path and query
	Proto      string
	Header     map[string][]string // as logged: credentials may read Redacted
	RemoteIP   string
	RemotePort string
	ClientIP   string // empty in logs of releases before v2.7
	UserID     string // the authenticated user, when an auth handler set one
	Status     int
	RespHeader map[string][]string
	TLS        bool
	// Fields are the top-level fields asked for (ParseFields) that the
	// line has as strings: those `log_append` adds.
	Fields map[string]string
}

// Duration is how long the request took, in µs.
func (e *Entry) Duration() int64 { return e.End - e.Start }

// line is an access log line as Caddy's JSON encoder writes it; Ts and
// Duration are raw, for their several formats.
type line struct {
	Logger   string          `json:"logger"`
	Ts       json.RawMessage `json:"ts"`
	Duration json.RawMessage `json:"duration"`
	Status   int             `json:"status"`
	UserID   string          `json:"user_id"`
	Request  *struct {
		RemoteIP   string              `json:"remote_ip"`
		RemotePort string              `json:"remote_port"`
		RemoteAddr string              `json:"remote_addr"` // before v2.5
		ClientIP   string              `json:"client_ip"`
		Proto      string              `json:"proto"`
		Method     string              `json:"method"`
		Host       string              `json:"host"`
		URI        string              `json:"uri"`
		Headers    map[string][]string `json:"headers"`
		TLS        json.RawMessage     `json:"tls"`
	} `json:"request"`
	RespHeaders map[string][]string `json:"resp_headers"`
}

// Why a line is not an entry.
var (
	// ErrNotAccess: a JSON line of another logger (Caddy's own messages in
	// the same file, an error log), or without a request.
	ErrNotAccess = errors.New("not an access log entry")
	// ErrNoTime: an entry whose `ts` is missing or unreadable.
	ErrNoTime = errors.New("no readable ts")
)

// Parse reads one line of an access log into e.
func Parse(b []byte, e *Entry) error { return ParseFields(b, e, nil) }

// ParseFields is Parse, also reading the top-level string fields named
// into e.Fields.
func ParseFields(b []byte, e *Entry, fields []string) error {
	var l line
	if err := json.Unmarshal(b, &l); err != nil {
		return err
	}
	if l.Request == nil || l.Logger != "" && !strings.HasPrefix(l.Logger, "http.log.access") {
		return ErrNotAccess
	}
	end, ok := parseTime(l.Ts)
	if !ok {
		return ErrNoTime
	}
	dur := parseDuration(l.Duration)
	rq := l.Request
	*e = Entry{
		Start: end - dur, End: end,
		Method: rq.Method, Host: rq.Host, URI: rq.URI, Proto: rq.Proto,
		Header: rq.Headers, RemoteIP: rq.RemoteIP, RemotePort: rq.RemotePort, ClientIP: rq.ClientIP,
		UserID: l.UserID, Status: l.Status, RespHeader: l.RespHeaders,
		TLS: len(rq.TLS) > 0 && string(rq.TLS) != "null",
	}
	if e.RemoteIP == "" && rq.RemoteAddr != "" {
		if host, port, err := net.SplitHostPort(rq.RemoteAddr); err == nil {
			e.RemoteIP, e.RemotePort = host, port
		} else {
			e.RemoteIP = rq.RemoteAddr
		}
	}
	if e.Method == "" {
		e.Method = "GET"
	}
	if len(fields) > 0 {
		var all map[string]json.RawMessage
		if json.Unmarshal(b, &all) == nil {
			for _, f := range fields {
				var v string
				if raw, ok := all[f]; ok && json.Unmarshal(raw, &v) == nil {
					if e.Fields == nil {
						e.Fields = map[string]string{}
					}
					e.Fields[f] = v
				}
			}
		}
	}
	return nil
}

// parseTime reads `ts` in Unix µs, whatever the encoder's time_format:
// seconds (the default, a float), milliseconds or nanoseconds (numbers
// told apart by their size), or a date string (ISO 8601, RFC 3339, wall,
// common log).
func parseTime(raw json.RawMessage) (int64, bool) {
	if len(raw) == 0 {
		return 0, false
	}
	if raw[0] == '"' {
		var s string
		if json.Unmarshal(raw, &s) != nil {
			return 0, false
		}
		for _, layout := range timeLayouts {
			if t, err := time.Parse(layout, s); err == nil {
				return t.UnixMicro(), true
			}
		}
		return 0, false
	}
	f, err := strconv.ParseFloat(string(raw), 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) || f <= 0 {
		return 0, false
	}
	switch {
	case f < 1e11: // seconds: until the year 5138
		return int64(math.Round(f * 1e6)), true
	case f < 1e14: // milliseconds
		return int64(math.Round(f * 1e3)), true
	case f < 1e17: // microseconds
		return int64(f), true
	case f < 9.2e18: // nanoseconds
		return int64(f) / 1000, true
	}
	return 0, false
}

// timeLayouts are the string forms of Caddy's time_format.
var timeLayouts = []string{
	time.RFC3339Nano,
	"2006-01-02T15:04:05.000Z0700", // iso8601
	"2006/01/02 15:04:05.000000000",
	"2006/01/02 15:04:05.000",
	"2006/01/02 15:04:05",        // wall
	"02/Jan/2006:15:04:05 -0700", // common_log
}

// maxDuration bounds a request's duration: a longer or unreadable one is
// read as 0 (an instant request) rather than one that ran for ages.
const maxDuration = int64(30 * 24 * time.Hour / time.Microsecond)

// parseDuration reads `duration` in µs, whatever the encoder's
// duration_format: seconds (the default, a float), nanoseconds (an integer
// of 1000 or more, which seconds never are) or a Go duration string; 0 when it is missing
// or unreadable.
func parseDuration(raw json.RawMessage) int64 {
	if len(raw) == 0 {
		return 0
	}
	var us int64
	if raw[0] == '"' {
		var s string
		if json.Unmarshal(raw, &s) != nil {
			return 0
		}
		d, err := time.ParseDuration(s)
		if err != nil {
			return 0
		}
		us = d.Microseconds()
	} else {
		f, err := strconv.ParseFloat(string(raw), 64)
		if err != nil || math.IsNaN(f) || f < 0 || math.IsInf(f, 0) {
			return 0
		}
		if f >= 1000 && !strings.ContainsAny(string(raw), ".eE") {
			// Nanoseconds (duration_format nano): seconds are written as a
			// float, and a request of a whole 1000 s or more, to the
			// nanosecond, is not one to expect.
			us = int64(f) / 1000
		} else {
			us = int64(math.Round(f * 1e6))
		}
	}
	if us < 0 || us > maxDuration {
		return 0
	}
	return us
}
