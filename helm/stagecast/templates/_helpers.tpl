{{/* vim: set filetype=mustache: */}}

{{- define "stagecast.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Full name prefix of every resource. Truncated to 40 so that "<fullname>-stage-headless" and the
stage pods' hostnames ("<fullname>-stage-N") stay valid DNS labels (<= 63).
*/}}
{{- define "stagecast.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "stagecast.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "stagecast.coordinator.fullname" -}}{{ include "stagecast.fullname" . }}-coordinator{{- end -}}
{{- define "stagecast.gateway.fullname" -}}{{ include "stagecast.fullname" . }}-gateway{{- end -}}
{{- define "stagecast.stage.fullname" -}}{{ include "stagecast.fullname" . }}-stage{{- end -}}
{{- define "stagecast.stage.headless" -}}{{ include "stagecast.fullname" . }}-stage-headless{{- end -}}

{{- define "stagecast.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "stagecast.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Labels shared by every object. */}}
{{- define "stagecast.labels" -}}
helm.sh/chart: {{ include "stagecast.chart" . }}
{{ include "stagecast.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: stagecast
{{- end -}}

{{/* Release-wide selector: every pod of this release (used by the NetworkPolicies). */}}
{{- define "stagecast.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stagecast.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Component labels; call with (dict "ctx" $ "component" "stage"). */}}
{{- define "stagecast.componentLabels" -}}
{{ include "stagecast.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "stagecast.componentSelectorLabels" -}}
{{ include "stagecast.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "stagecast.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag | toString) -}}
{{- end -}}

{{/* host:port of the coordinator, as handed to stages and gateways. */}}
{{- define "stagecast.coordinator.address" -}}
{{- printf "%s.%s.svc.%s:%d" (include "stagecast.coordinator.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.coordinator.port) -}}
{{- end -}}

{{/* Checkpoint directory inside the containers: <mountPath>/<subPath>. */}}
{{- define "stagecast.checkpointDir" -}}
{{- $mount := trimSuffix "/" .Values.model.mountPath -}}
{{- $sub := trimAll "/" (default "" .Values.model.subPath) -}}
{{- if $sub -}}{{ printf "%s/%s" $mount $sub }}{{- else -}}{{ $mount }}{{- end -}}
{{- end -}}

{{/*
Native gRPC probe; call with (dict "port" 50060 "probe" .Values.x.probes.startup).
`enabled` and `service` are consumed here, all other keys pass through.
*/}}
{{- define "stagecast.grpcProbe" -}}
grpc:
  port: {{ int .port }}
  service: {{ default "" .probe.service | quote }}
{{- with (omit .probe "enabled" "service") }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Environment shared by every stagecast container: pod identity and the OpenTelemetry
configuration (standard OTEL_* variables only). Call with (dict "ctx" $ "component" "gateway").
*/}}
{{- define "stagecast.commonEnv" -}}
{{- $ := .ctx -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: PYTHONUNBUFFERED
  value: "1"
# The root filesystem is read-only: everything that caches on disk writes under the /tmp emptyDir.
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/cache
- name: TORCHINDUCTOR_CACHE_DIR
  value: /tmp/cache/torchinductor
- name: TRITON_CACHE_DIR
  value: /tmp/cache/triton
- name: CUDA_CACHE_PATH
  value: /tmp/cache/nv
{{ include "stagecast.otelEnv" . | trim }}
{{- end -}}

{{- define "stagecast.otelEnv" -}}
{{- $ := .ctx -}}
{{- $t := $.Values.tracing -}}
{{- $attrs := list "k8s.namespace.name=$(POD_NAMESPACE)" "k8s.pod.name=$(POD_NAME)" "k8s.node.name=$(NODE_NAME)" (printf "service.namespace=%s" $.Release.Name) (printf "service.version=%s" (default $.Chart.AppVersion $.Values.image.tag | toString)) (printf "stagecast.component=%s" .component) -}}
{{- range $k, $v := $t.resourceAttributes }}
{{- $attrs = append $attrs (printf "%s=%v" $k $v) -}}
{{- end }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "stagecast-%s" .component | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attrs | quote }}
{{- if $t.enabled }}
- name: OTEL_SDK_DISABLED
  value: "false"
- name: OTEL_TRACES_EXPORTER
  value: "otlp"
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $t.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $t.protocol | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $t.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $t.ratio | toString | quote }}
{{- else }}
- name: OTEL_SDK_DISABLED
  value: "true"
- name: OTEL_TRACES_EXPORTER
  value: "none"
{{- end }}
{{- end -}}

{{/* resources + nvidia.com/gpu (requests == limits) when device is cuda. */}}
{{- define "stagecast.resources" -}}
{{- $res := deepCopy (default dict .resources) -}}
{{- if and (eq .device "cuda") (gt (int .gpus) 0) -}}
{{- $req := deepCopy (default dict (get $res "requests")) -}}
{{- $lim := deepCopy (default dict (get $res "limits")) -}}
{{- $_ := set $req "nvidia.com/gpu" (int .gpus) -}}
{{- $_ := set $lim "nvidia.com/gpu" (int .gpus) -}}
{{- $_ := set $res "requests" $req -}}
{{- $_ := set $res "limits" $lim -}}
{{- end -}}
{{- if $res -}}
{{ toYaml $res }}
{{- else -}}
{}
{{- end -}}
{{- end -}}

{{/* Model volume (PVC, hostPath, or the demo emptyDir). */}}
{{- define "stagecast.modelVolume" -}}
- name: model
{{- if .Values.model.demo.enabled }}
  emptyDir:
    sizeLimit: {{ .Values.model.demo.sizeLimit }}
{{- else if .Values.model.pvc.claimName }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    {{- with .Values.model.hostPath.type }}
    type: {{ . }}
    {{- end }}
{{- end }}
{{- end -}}

{{- define "stagecast.modelVolumeMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end -}}

{{/* initContainer waiting for the model Job to fill the volume (model.fill.enabled). */}}
{{- define "stagecast.modelWaitInitContainer" -}}
{{- if .Values.model.fill.enabled -}}
- name: wait-for-model
  image: {{ include "stagecast.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["python", "-m", "launcher.fetch_model"]
  args:
    - wait
    - --out
    - {{ include "stagecast.checkpointDir" . }}
    - --timeout
    - {{ .Values.model.fill.waitSeconds | quote }}
  {{- with .Values.containerSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  resources:
    requests:
      cpu: 10m
      memory: 64Mi
    limits:
      memory: 256Mi
  volumeMounts:
    {{- include "stagecast.modelVolumeMount" . | nindent 4 }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end -}}

{{/* initContainer writing the tiny demo checkpoint (model.demo.enabled). */}}
{{- define "stagecast.demoInitContainer" -}}
{{- if .Values.model.demo.enabled -}}
- name: demo-checkpoint
  image: {{ include "stagecast.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args:
    - demo-checkpoint
    - --out
    - {{ include "stagecast.checkpointDir" . }}
  {{- with .Values.containerSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.model.demo.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end -}}

{{- define "stagecast.shmVolume" -}}
{{- if .shm.enabled -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shm.sizeLimit }}
{{- end }}
{{- end -}}

{{/*
Render-time validation. Included by every workload template so that `helm template`,
`helm install` and `helm lint` all stop with a clear message.
*/}}
{{- define "stagecast.validate" -}}
{{- $v := .Values -}}
{{- if not $v.image.repository -}}
{{- fail "stagecast: image.repository is empty: stagecast publishes no image. Build docker/Dockerfile (GPU) or docker/Dockerfile.cpu, push it to a registry your nodes pull from (or `kind load docker-image` it), and set image.repository (and image.tag); see the chart README, \"From nothing to a stream\"" -}}
{{- end -}}
{{- $count := int $v.stages.count -}}
{{- if lt $count 1 -}}
{{- fail (printf "stagecast: stages.count must be >= 1 (got %d): the pipeline needs at least one stage" $count) -}}
{{- end -}}
{{- $numLayers := int $v.model.numLayers -}}
{{- if lt $numLayers 1 -}}
{{- fail (printf "stagecast: model.numLayers must be >= 1 (got %d)" $numLayers) -}}
{{- end -}}
{{- if and (gt (int ($v.stages.sp | default 1)) 1) $v.stages.cudaGraphs (eq $v.device "cuda") -}}
{{- fail "stagecast: stages.cudaGraphs is not supported with stages.sp > 1 yet: turn one of them off" -}}
{{- end -}}
{{- if and $v.stages.fp8 (ne $v.device "cuda") -}}
{{- fail (printf "stagecast: stages.fp8 needs device \"cuda\" (got %q): float8 linears run on GPUs of compute capability 8.9+" $v.device) -}}
{{- end -}}
{{- if and $v.stages.fp8 (ne $v.dtype "bfloat16") -}}
{{- fail (printf "stagecast: stages.fp8 needs dtype \"bfloat16\" (got %q): float8 linears take and give bfloat16" $v.dtype) -}}
{{- end -}}
{{- if and (gt (int ($v.stages.sp | default 1)) 1) (gt (int ($v.stages.cfgParallel | default 1)) 1) -}}
{{- fail "stagecast: stages.cfgParallel 2 does not compose with stages.sp > 1 yet: set one of them to 1" -}}
{{- end -}}
{{- with $v.gateway.tinyDecoder -}}
{{- if or (hasPrefix "/" .) (has ".." (splitList "/" .)) -}}
{{- fail (printf "stagecast: gateway.tinyDecoder %q must be a path inside the model volume, relative to model.mountPath (e.g. taehv/taew2_1.pth)" .) -}}
{{- end -}}
{{- end -}}
{{- if gt $count $numLayers -}}
{{- fail (printf "stagecast: stages.count (%d) cannot exceed model.numLayers (%d): every stage needs at least one transformer block" $count $numLayers) -}}
{{- end -}}
{{- with $v.stages.partition -}}
{{- if ne (len .) $count -}}
{{- fail (printf "stagecast: stages.partition %v has %d entries but stages.count is %d: give one block count per stage" . (len .) $count) -}}
{{- end -}}
{{- $sum := 0 -}}
{{- range . -}}
{{- if lt (int .) 1 -}}
{{- fail (printf "stagecast: stages.partition entries must be >= 1 (got %v)" .) -}}
{{- end -}}
{{- $sum = add $sum (int .) -}}
{{- end -}}
{{- if ne (int $sum) $numLayers -}}
{{- fail (printf "stagecast: stages.partition %v sums to %d but model.numLayers is %d: the stages must cover every transformer block exactly once" . $sum $numLayers) -}}
{{- end -}}
{{- end -}}
{{- if and $v.web.enabled (eq $v.web.media.mode "turn") (not $v.web.media.turn.url) -}}
{{- fail "stagecast: web.media.mode is turn but web.media.turn.url is empty: give the TURN server's URL (turn:HOST:PORT), or use mode direct or hostNetwork" -}}
{{- end -}}
{{- $ing := $v.web.ingress -}}
{{- if and $v.web.enabled $ing.enabled -}}
{{- if not (or $ing.tls $ing.certManager.clusterIssuer $ing.certManager.issuer) -}}
{{- fail "stagecast: web.ingress.enabled exposes the page, which sends bearer tokens: serve it with TLS (set web.ingress.tls, or web.ingress.certManager.clusterIssuer / issuer)" -}}
{{- end -}}
{{- if and $ing.certManager.clusterIssuer $ing.certManager.issuer -}}
{{- fail "stagecast: set only one of web.ingress.certManager.clusterIssuer and web.ingress.certManager.issuer" -}}
{{- end -}}
{{- if and $v.networkPolicy.enabled (not $ing.from) -}}
{{- fail "stagecast: web.ingress.enabled needs web.ingress.from: the NetworkPolicyPeers of the Ingress controller's pods (the page's port is closed to everything outside the release otherwise)" -}}
{{- end -}}
{{- end -}}
{{- if not (has $v.device (list "cuda" "cpu")) -}}
{{- fail (printf "stagecast: device must be \"cuda\" or \"cpu\" (got %q)" (toString $v.device)) -}}
{{- end -}}
{{- if and (eq $v.device "cuda") (lt (int $v.stages.gpusPerStage) 1) -}}
{{- fail "stagecast: device is \"cuda\" but stages.gpusPerStage < 1: give every stage a GPU or use device: cpu" -}}
{{- end -}}
{{- if and (eq $v.device "cuda") (gt (int $v.stages.gpusPerStage) 1) -}}
{{- fail (printf "stagecast: stages.gpusPerStage is %d but a stage process drives one GPU, so the others would sit idle: for more GPUs per stage set stages.sp (sequence parallel: one pod per GPU) or split the model over more stages.count" (int $v.stages.gpusPerStage)) -}}
{{- end -}}
{{- $sources := 0 -}}
{{- if $v.model.pvc.claimName }}{{ $sources = add1 $sources }}{{ end -}}
{{- if $v.model.hostPath.path }}{{ $sources = add1 $sources }}{{ end -}}
{{- if $v.model.demo.enabled }}{{ $sources = add1 $sources }}{{ end -}}
{{- if eq (int $sources) 0 -}}
{{- fail "stagecast: no model path: set model.pvc.claimName (an existing PVC holding the checkpoint), model.hostPath.path, or model.demo.enabled=true (tiny CPU demo checkpoint)" -}}
{{- end -}}
{{- if gt (int $sources) 1 -}}
{{- fail "stagecast: set only one of model.pvc.claimName, model.hostPath.path and model.demo.enabled" -}}
{{- end -}}
{{- $fill := $v.model.fill -}}
{{- if $fill.enabled -}}
{{- if not $v.model.pvc.claimName -}}
{{- fail "stagecast: model.fill.enabled needs a PVC to fill: model.pvc.claimName (model.pvc.create.enabled=true makes it); a hostPath or the demo checkpoint cannot be filled by a Job" -}}
{{- end -}}
{{- if eq (len (compact (list $fill.repo $fill.copyFrom.path))) 1 | not -}}
{{- fail "stagecast: model.fill.enabled: set exactly one of model.fill.repo (Hugging Face) and model.fill.copyFrom.path (with model.fill.copyFrom.volume)" -}}
{{- end -}}
{{- if and $fill.copyFrom.path (not $fill.copyFrom.volume) -}}
{{- fail "stagecast: model.fill.copyFrom.path needs model.fill.copyFrom.volume (the Volume source it lies in)" -}}
{{- end -}}
{{- $convert := compact (list $fill.convert.repo $fill.convert.file $fill.convert.source) -}}
{{- if and (gt (len $convert) 0) (lt (len $convert) 3) -}}
{{- fail "stagecast: model.fill.convert: set repo, file and source together (or none)" -}}
{{- end -}}
{{- if and $fill.convert.repo (not $fill.repo) -}}
{{- fail "stagecast: model.fill.convert needs model.fill.repo: the diffusers base whose VAE and text encoder the converted model uses" -}}
{{- end -}}
{{- end -}}
{{- if and $v.model.pvc.create.enabled (not $v.model.pvc.claimName) -}}
{{- fail "stagecast: model.pvc.create.enabled needs model.pvc.claimName (the name of the PVC to create)" -}}
{{- end -}}
{{- if not (hasPrefix "/" (toString $v.model.mountPath)) -}}
{{- fail (printf "stagecast: model.mountPath must be an absolute path (got %q)" (toString $v.model.mountPath)) -}}
{{- end -}}
{{- end -}}

{{/* Stage anti-affinity preset (stages.podAntiAffinity). */}}
{{- define "stagecast.stage.affinity" -}}
{{- if .Values.stages.affinity -}}
{{ tpl (toYaml .Values.stages.affinity) . }}
{{- else if eq .Values.stages.podAntiAffinity "hard" -}}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- include "stagecast.componentSelectorLabels" (dict "ctx" . "component" "stage") | nindent 10 }}
{{- else if eq .Values.stages.podAntiAffinity "soft" -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "stagecast.componentSelectorLabels" (dict "ctx" . "component" "stage") | nindent 12 }}
{{- end -}}
{{- end -}}

{{/*
Security flags of a service container: its role's mTLS Secret (mounted by stagecast.securityVolumes) and, with
"healthPort", the plaintext health-only port the probes use. Call with (dict "ctx" $ "healthPort" 8081).
*/}}
{{- define "stagecast.securityArgs" -}}
- --mtls
- /etc/stagecast/mtls
{{- with .healthPort }}
- --health-port
- {{ . | int | quote }}
{{- end }}
{{- end -}}

{{/* Mounts of stagecast.securityVolumes. Call with (dict "ctx" $ "component" "gateway"), and "volume" where one pod
holds several roles (a fleet's leader: "mtls-<role>"). */}}
{{- define "stagecast.securityMounts" -}}
- name: {{ .volume | default "mtls" }}
  mountPath: /etc/stagecast/mtls
  readOnly: true
{{- if eq .component "gateway" }}
- name: tokens
  mountPath: /etc/stagecast/tokens
  readOnly: true
{{- if .ctx.Values.security.gatewayTLS.enabled }}
- name: gateway-tls
  mountPath: /etc/stagecast/gateway-tls
  readOnly: true
{{- end }}
{{- end }}
{{- end -}}

{{/* The Secrets a component reads: its mTLS certificate; the gateway also its tokens and public TLS. */}}
{{- define "stagecast.securityVolumes" -}}
{{- $ := .ctx -}}
- name: {{ .volume | default "mtls" }}
  secret:
    secretName: {{ printf "%s-mtls-%s" (include "stagecast.fullname" $) .component }}
    defaultMode: 0440
{{- if eq .component "gateway" }}
- name: tokens
  secret:
    secretName: {{ include "stagecast.tokensSecret" $ }}
    defaultMode: 0440
    items:
      - key: tokens
        path: tokens
{{- if $.Values.security.gatewayTLS.enabled }}
- name: gateway-tls
  secret:
    secretName: {{ include "stagecast.gatewayTLSSecret" $ }}
    defaultMode: 0440
{{- end }}
{{- end }}
{{- end -}}

{{- define "stagecast.tokensSecret" -}}
{{- default (printf "%s-tokens" (include "stagecast.fullname" .)) .Values.security.tokens.existingSecret -}}
{{- end -}}

{{- define "stagecast.gatewayTLSSecret" -}}
{{- default (printf "%s-gateway-tls" (include "stagecast.fullname" .)) .Values.security.gatewayTLS.secretName -}}
{{- end -}}

{{/*
The names the gateway's public certificate carries, as a JSON list: the gateway Service's in-cluster names,
localhost, 127.0.0.1, gateway.tls.extraNames (the address clients dial: a DNS name or an IP), and with a
LoadBalancer Service the address it was given (looked up, so an upgrade after the first install adds it).
*/}}
{{- define "stagecast.gatewayTLSNames" -}}
{{- $gw := include "stagecast.gateway.fullname" . -}}
{{- $ns := .Release.Namespace -}}
{{- $names := list $gw (printf "%s.%s" $gw $ns) (printf "%s.%s.svc" $gw $ns) (printf "%s.%s.svc.%s" $gw $ns .Values.clusterDomain) "localhost" "127.0.0.1" -}}
{{- range .Values.gateway.tls.extraNames }}{{ $names = append $names . }}{{ end -}}
{{- if eq .Values.gateway.service.type "LoadBalancer" -}}
{{- $svc := lookup "v1" "Service" $ns $gw -}}
{{- range (dig "status" "loadBalancer" "ingress" list $svc) -}}
{{- with .ip }}{{ $names = append $names . }}{{ end -}}
{{- with .hostname }}{{ $names = append $names . }}{{ end -}}
{{- end -}}
{{- end -}}
{{- toJson (uniq $names) -}}
{{- end -}}

{{/* Whether a certificate name is an IP address (IPv4 dotted quad or IPv6) rather than a DNS name. */}}
{{- define "stagecast.isIP" -}}
{{- if or (regexMatch "^[0-9]+\\.[0-9]+\\.[0-9]+\\.[0-9]+$" .) (contains ":" .) }}true{{ end -}}
{{- end -}}
