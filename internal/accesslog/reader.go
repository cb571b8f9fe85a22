package accesslog

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
)

// MaxLine bounds a line: a longer one (a request with megabytes of
// headers) is skipped and counted, so that memory stays bounded whatever
// a log holds.
const MaxLine = 1 << 20

// Stats counts what a Reader read.
type Stats struct {
	Files   []string `json:"files"`
	Lines   int64    `json:"lines"`
	Entries int64    `json:"entries"`
	// Lines that are not entries: JSON of another logger (Caddy's own
	// messages), lines that are not JSON or not an entry's shape, lines
	// without a readable ts, lines longer than MaxLine.
	NotAccess  int64 `json:"not_access"`
	Unreadable int64 `json:"unreadable"`
	NoTime     int64 `json:"no_time"`
	TooLong    int64 `json:"too_long"`
	// FirstProblem names the first line that was not read, and why.
	FirstProblem string `json:"first_problem,omitempty"`
}

// Reader reads the entries of access log files one after the other,
// in the order of their first entries' times (rotated files, whatever
// order they are given in), decompressing those that are gzip.
type Reader struct {
	// Fields are the top-level fields each entry's Fields gets.
	Fields []string
	files  []*logFile
	cur    int
	stats  Stats
	err    error
}

type logFile struct {
	name  string
	first int64 // the End of its first entry, for the order
	open  func() (io.ReadCloser, error)
	rc    io.ReadCloser
	br    *bufio.Reader
	line  int64
}

// Open opens the files ("-" is standard input, read last). Each is read
// lazily; Open reads only as far as each file's first entry.
func Open(paths []string) (*Reader, error) {
	r := &Reader{}
	for _, p := range paths {
		f := &logFile{name: p}
		if p == "-" {
			f.open = func() (io.ReadCloser, error) { return io.NopCloser(os.Stdin), nil }
			f.first = 1<<63 - 1
		} else {
			path := p
			f.open = func() (io.ReadCloser, error) { return os.Open(path) }
			first, err := firstTime(f)
			if err != nil {
				return nil, err
			}
			f.first = first
		}
		r.files = append(r.files, f)
		r.stats.Files = append(r.stats.Files, p)
	}
	sort.SliceStable(r.files, func(i, j int) bool { return r.files[i].first < r.files[j].first })
	return r, nil
}

// NewReader reads the entries of one stream, named name in messages.
func NewReader(name string, rd io.Reader) *Reader {
	f := &logFile{name: name, open: func() (io.ReadCloser, error) { return io.NopCloser(rd), nil }}
	return &Reader{files: []*logFile{f}, stats: Stats{Files: []string{name}}}
}

// firstTime is the End of the file's first entry (the file's end time, 0,
// when it has none), reading no more than its first lines.
func firstTime(f *logFile) (int64, error) {
	rc, err := f.open()
	if err != nil {
		return 0, err
	}
	defer rc.Close()
	br, err := decompressed(rc)
	if err != nil {
		return 0, fmt.Errorf("%s: %v", f.name, err)
	}
	var e Entry
	for range 1000 {
		b, err := readLine(br)
		if err == io.EOF {
			return 0, nil
		}
		if err != nil && !errors.Is(err, bufio.ErrBufferFull) {
			return 0, nil // read as it can be when its turn comes
		}
		if err == nil && Parse(b, &e) == nil {
			return e.End, nil
		}
	}
	return 0, nil
}

// decompressed is r, gunzipped when it starts as gzip does.
func decompressed(r io.Reader) (*bufio.Reader, error) {
	br := bufio.NewReaderSize(r, 64<<10)
	magic, _ := br.Peek(2)
	if len(magic) == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, fmt.Errorf("not a gzip file: %v", err)
		}
		return bufio.NewReaderSize(zr, 64<<10), nil
	}
	return br, nil
}

// readLine is the next line without its end; a line longer than MaxLine
// is read to its end and returned with bufio.ErrBufferFull.
func readLine(br *bufio.Reader) ([]byte, error) {
	b, err := br.ReadSlice('\n')
	if err == nil || err == io.EOF && len(b) > 0 {
		return bytes.TrimRight(b, "\r\n"), nil
	}
	if !errors.Is(err, bufio.ErrBufferFull) {
		return nil, err
	}
	// Longer than the buffer: gather it up to MaxLine, then skip the rest.
	long := append([]byte(nil), b...)
	for {
		b, err = br.ReadSlice('\n')
		if len(long) <= MaxLine {
			long = append(long, b...)
		}
		if err == nil || err == io.EOF {
			break
		}
		if !errors.Is(err, bufio.ErrBufferFull) {
			return nil, err
		}
	}
	if len(long) > MaxLine {
		return nil, bufio.ErrBufferFull
	}
	return bytes.TrimRight(long, "\r\n"), nil
}

// Next reads the next entry into e: false at the end of the last file or
// on an error reading one (Err). Lines that are not entries are counted
// and skipped.
func (r *Reader) Next(e *Entry) bool {
	for r.err == nil && r.cur < len(r.files) {
		f := r.files[r.cur]
		if f.br == nil {
			rc, err := f.open()
			if err != nil {
				r.err = err
				return false
			}
			f.rc = rc
			if f.br, err = decompressed(rc); err != nil {
				r.err = fmt.Errorf("%s: %v", f.name, err)
				return false
			}
		}
		b, err := readLine(f.br)
		switch {
		case err == io.EOF:
			f.rc.Close()
			r.cur++
			continue
		case errors.Is(err, bufio.ErrBufferFull):
			f.line++
			r.stats.Lines++
			r.stats.TooLong++
			r.problem(f, "longer than 1 MiB")
			continue
		case err != nil:
			r.err = fmt.Errorf("%s: line %d: %v", f.name, f.line+1, err)
			return false
		}
		f.line++
		if len(bytes.TrimSpace(b)) == 0 {
			continue
		}
		r.stats.Lines++
		switch err := ParseFields(b, e, r.Fields); {
		case err == nil:
			r.stats.Entries++
			return true
		case errors.Is(err, ErrNotAccess):
			r.stats.NotAccess++
		case errors.Is(err, ErrNoTime):
			r.stats.NoTime++
			r.problem(f, "no readable ts")
		default:
			r.stats.Unreadable++
			r.problem(f, "not an access log entry: "+err.Error())
		}
	}
	return false
}

func (r *Reader) problem(f *logFile, why string) {
	if r.stats.FirstProblem == "" {
		r.stats.FirstProblem = fmt.Sprintf("%s line %d: %s", f.name, f.line, why)
	}
}

// Err is the error that stopped the reading, if any (a line that is not
// an entry is no error).
func (r *Reader) Err() error { return r.err }

// Stats is what was read so far.
func (r *Reader) Stats() Stats { return r.stats }

// Close closes the file being read.
func (r *Reader) Close() error {
	if r.cur < len(r.files) && r.files[r.cur].rc != nil {
		return r.files[r.cur].rc.Close()
	}
	return nil
}
