package accesslog

import (
	"sort"
	"strconv"
	"unicode/utf8"
)

// AppendJSON appends e to b as the line Caddy's JSON encoder writes for
// it (ts and duration in seconds, headers in sorted order), ending with a
// newline.
func AppendJSON(b []byte, e *Entry) []byte {
	b = append(b, `{"level":"info","ts":`...)
	b = appendSeconds(b, e.End)
	b = append(b, `,"logger":"http.log.access.log0","msg":"handled request","request":{"remote_ip":`...)
	b = appendString(b, e.RemoteIP)
	b = append(b, `,"remote_port":`...)
	b = appendString(b, e.RemotePort)
	if e.ClientIP != "" {
		b = append(b, `,"client_ip":`...)
		b = appendString(b, e.ClientIP)
	}
	b = append(b, `,"proto":`...)
	b = appendString(b, e.Proto)
	b = append(b, `,"method":`...)
	b = appendString(b, e.Method)
	b = append(b, `,"host":`...)
	b = appendString(b, e.Host)
	b = append(b, `,"uri":`...)
	b = appendString(b, e.URI)
	b = append(b, `,"headers":`...)
	b = appendHeader(b, e.Header)
	if e.TLS {
		b = append(b, `,"tls":{"resumed":false,"version":772,"cipher_suite":4865,"proto":"h2","server_name":`...)
		b = appendString(b, e.Host)
		b = append(b, '}')
	}
	b = append(b, `},"bytes_read":0,"user_id":`...)
	b = appendString(b, e.UserID)
	b = append(b, `,"duration":`...)
	b = appendSeconds(b, e.End-e.Start)
	b = append(b, `,"size":512,"status":`...)
	b = strconv.AppendInt(b, int64(e.Status), 10)
	b = append(b, `,"resp_headers":`...)
	b = appendHeader(b, e.RespHeader)
	for _, k := range sortedNames(e.Fields) { // log_append's
		b = append(b, ',')
		b = appendString(b, k)
		b = append(b, ':')
		b = appendString(b, e.Fields[k])
	}
	return append(b, "}\n"...)
}

// appendSeconds writes µs as seconds with six decimals, as zap writes a
// float of seconds.
func appendSeconds(b []byte, us int64) []byte {
	return strconv.AppendFloat(b, float64(us)/1e6, 'f', -1, 64)
}

func sortedNames[V any](m map[string]V) []string {
	names := make([]string, 0, len(m))
	for k := range m {
		names = append(names, k)
	}
	sort.Strings(names)
	return names
}

func appendHeader(b []byte, h map[string][]string) []byte {
	b = append(b, '{')
	for i, k := range sortedNames(h) {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendString(b, k)
		b = append(b, ":["...)
		for j, v := range h[k] {
			if j > 0 {
				b = append(b, ',')
			}
			b = appendString(b, v)
		}
		b = append(b, ']')
	}
	return append(b, '}')
}

// appendString writes s as a JSON string.
func appendString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' && c < utf8.RuneSelf {
			b = append(b, c)
			i++
			continue
		}
		if c < utf8.RuneSelf {
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\t':
				b = append(b, '\\', 't')
			case '\r':
				b = append(b, '\\', 'r')
			default:
				b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&15])
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, `\ufffd`...)
		} else {
			b = append(b, s[i:i+size]...)
		}
		i += size
	}
	return append(b, '"')
}
